"""Test-wide settings: IR invariants are verified after every pass; Triton kernels run
interpreted on a machine without CUDA (set before anything imports triton; spawned CPU ranks
always get it, see multirank.py); tests that need GPUs are marked, and skipped, with the reason,
where there are fewer.

Markers (the only place they are declared):
- ``cuda``: needs a CUDA GPU (NCCL on one rank, Triton kernels launched for real, the comm
  stream and its events, a plan on ``cuda``);
- ``two_gpus``: needs two CUDA GPUs on this machine (two NCCL ranks, one GPU each);
- ``slow``: a case of a long multi-rank sweep whose other cases cover the same code; run only
  with ``pytest --slow`` (or ``ZEROCC_SLOW=1``), and the default run says how many it left out.
  Keeps the default suite, what CI runs, under 20 minutes on a 2-core machine.

``pytest tests/parity --backend inductor`` (or ``inductor-whole``) trains every parity case
that names no backend under that backend, with the tolerances tests/parity/__init__.py gives a
compiling backend; the default is eager, the bit-identical reference, and
tests/parity/test_inductor_parity.py holds a subset to Inductor in every run. Other tests hold
the eager backend's numbers: under another backend they are skipped, with that reason.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("ZEROCC_VERIFY", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests import their helper modules (models, multirank) and the example GPT by name.
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "gpt"))

GPU_MARKERS = {"cuda": 1, "two_gpus": 2}  # marker: GPUs the test needs


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow", action="store_true", help="also run the cases marked slow (long sweeps)"
    )
    parser.addoption(
        "--backend",
        default="eager",
        choices=["eager", "inductor", "inductor-whole", "inductor-regions"],
        help="the backend of the parity cases that name none (default: eager)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # The spawned ranks read it too (tests/parity/__init__.py, BACKEND_VARIABLE).
    os.environ["ZEROCC_TEST_BACKEND"] = config.getoption("--backend")
    if config.getoption("--slow"):  # (modules that size a sweep read it: test_teardown.py)
        os.environ["ZEROCC_SLOW"] = "1"
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "two_gpus: needs two CUDA GPUs (skipped with fewer)")
    config.addinivalue_line("markers", "slow: a long sweep's extra case (run with --slow)")
    # The project's own plans use the current field names (old ones only warn users). Added
    # here, not in pyproject: naming the class there imports zerocc, and so triton, before
    # TRITON_INTERPRET is set above.
    config.addinivalue_line("filterwarnings", "error::zerocc.errors.RenamedFieldWarning")


def _runs_slow(config: pytest.Config) -> bool:
    return bool(config.getoption("--slow") or os.environ.get("ZEROCC_SLOW"))


_SLOW_LEFT_OUT: list[str] = []
_EAGER_PARITY: list[str] = []  # the parity cases of a run under the eager backend


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _runs_slow(config):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
            _SLOW_LEFT_OUT[:] = [item.nodeid for item in slow]
    backend = config.getoption("--backend")
    parity = Path(__file__).parent / "parity"
    if backend == "eager":
        _EAGER_PARITY[:] = [item.nodeid for item in items if parity in Path(item.fspath).parents]
    else:
        reason = f"--backend {backend} runs the parity tests (tests/parity) alone"
        for item in items:
            if parity not in Path(item.fspath).parents:
                item.add_marker(pytest.mark.skip(reason=reason))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        for marker, needed in GPU_MARKERS.items():
            if item.get_closest_marker(marker) is not None and gpus < needed:
                reason = f"needs {needed} CUDA GPU(s); this machine has {gpus}"
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist, a worker hands what it collected to the controller, which prints
    the summary (every worker collects every test: any one's lists are whole)."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["zerocc_collected"] = (_SLOW_LEFT_OUT, _EAGER_PARITY)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """The controller's side (pytest-xdist): the lists the first worker to end collected."""
    slow, parity = getattr(node, "workeroutput", {}).get("zerocc_collected", ([], []))
    _SLOW_LEFT_OUT[:] = _SLOW_LEFT_OUT or slow
    _EAGER_PARITY[:] = _EAGER_PARITY or parity


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if config.getoption("--backend") != "eager":
        terminalreporter.write_line(
            f"parity cases that name no backend trained under {config.getoption('--backend')}"
        )
    if _EAGER_PARITY:
        terminalreporter.write_line(
            f"tests/parity: {len(_EAGER_PARITY)} cases, under the eager backend where a case "
            "names none (test_inductor_parity.py holds a subset to Inductor); `pytest "
            "tests/parity --backend inductor` (or inductor-whole) trains them all under "
            "Inductor, 14-50 min on 2 cores"
        )
    if _SLOW_LEFT_OUT:
        terminalreporter.write_line(
            f"{len(_SLOW_LEFT_OUT)} slow sweep cases not run (covered by the others); "
            "`pytest --slow` runs them too"
        )

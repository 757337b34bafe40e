"""Hugging Face models built for zerocc on the ``meta`` device, so that no rank ever holds a
whole model: zerocc reads or makes each unit's weights as it builds the unit's shards.

- :func:`pretrained`: a local folder's model, as ``from_pretrained`` gives it (to the bit),
  bound to its weight files (``zerocc.weights_from``).
- :func:`fresh`: a config's model with fresh weights, as transformers initializes them
  (:class:`Initialization`: its own ``initialize_weights``, one module at a time).

Where the meta build cannot give what transformers would (files it converts as it loads
them, a module its initialization does not cover), the model is built whole, with a warning
that says so.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerocc.compiler.capture import describe_model
from zerocc.compiler.materialize import module_seed, use_weights
from zerocc.errors import CaptureError, PlanError
from zerocc.runtime.checkpoint.weight_files import NotMapped, WeightFiles, bind, weights_from
from zerocc.runtime.machine_memory import host_available

HF_INSTALL = 'pip install "zerocc[hf]" (transformers and tokenizers)'
_LARGEST_TRIED = 2**26  # elements of a module initialized to check its kind (256 MiB in fp32)


def transformers_module() -> Any:
    """``transformers``, its warnings quieted (they would repeat per rank); PlanError saying
    how to install it where it is not."""
    try:
        import transformers
    except ImportError as exc:
        raise PlanError(
            f"the Hugging Face workloads need transformers: {HF_INSTALL} ({exc})"
        ) from None
    transformers.utils.logging.set_verbosity_error()
    return transformers


def pretrained(
    folder: str | os.PathLike,
    auto_class: str = "AutoModelForCausalLM",
    seed: int = 0,
    **overrides: Any,
) -> nn.Module:
    """A local Hugging Face model folder's model, for ``zerocc.compile``: what
    ``transformers.<auto_class>.from_pretrained(folder, dtype=torch.float32, **overrides)``
    gives (in train mode), but built on ``meta`` and bound to its weight files
    (``zerocc.weights_from``), so that zerocc reads each unit's weights as it builds the unit's
    shards and no rank ever holds the whole model.

    What the files lack is initialized now, as ``from_pretrained`` does it, by the model's own
    ``_init_weights``, from ``seed`` (so the same on every rank): the non-persistent buffers
    (rotary frequencies) and a head the files do not have (a classifier's ``score`` on a
    causal LM's files; the files' own ``lm_head`` is then warned of, unread). Files that do not
    match the model by name (transformers converts some checkpoints as it loads them), or that
    cannot be read one tensor at a time (torch's format before zip), are loaded by
    ``from_pretrained``, whole, with a warning that says so. Raises CheckpointError for a
    weight whose shape is not the model's, PlanError without transformers or config.json.
    """
    transformers = transformers_module()
    folder = Path(folder).expanduser()
    if not (folder / "config.json").is_file():
        raise PlanError(f"{folder}: no config.json (transformers needs it beside the weights)")
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True, **overrides)
    auto = _auto_model(transformers, auto_class)
    net = _on_meta(auto, config)
    try:
        bound = bind(WeightFiles(folder), net)
    except NotMapped as exc:  # torch's format before zip
        return _whole_pretrained(auto, folder, overrides, f"{exc}")
    buffers = {name for name, _ in net.named_buffers()}
    base = f"{net.base_model_prefix}." if net.base_model_prefix else ""
    foreign = [n for n in bound.missing if n not in buffers and n.startswith(base)]
    if foreign:
        why = f"{len(foreign)} of the model's weights are not in the files by name: "
        return _whole_pretrained(auto, folder, overrides, why + _shown(foreign))
    unset = _initialize(net, bound.missing, seed, _aliases(net), partial(_initialize_all, net))
    if unset:
        why = f"the model's initialization leaves {_shown(unset)} unset"
        return _whole_pretrained(auto, folder, overrides, why)
    weights_from(net, folder)
    return net


def fresh(auto: Any, config: Any, seed: int) -> nn.Module:
    """A config's model (``auto.from_config``) with fresh weights, for ``zerocc.compile``:
    built on ``meta``, each module's weights made by transformers' own initialization when
    zerocc builds its unit (:class:`Initialization`), so no rank holds the whole model. A model
    whose initialization does not cover some module (one of each kind is tried now) is built
    whole, with a warning, where the host has room for it (PlanError where it has not)."""
    net = _on_meta(auto, config)
    initialization = Initialization(net, seed)
    unset = initialization.uncovered()
    if not unset:
        use_weights(net, initialization)
        return net
    warnings.warn(
        f"transformers' initialization leaves {_shown(unset)} unset; building the model with "
        "from_config, whole in fp32 on each rank's host",
        stacklevel=3,
    )
    needed = sum(t.numel() * 4 for t in net.state_dict().values())
    available = host_available()
    if needed > available:
        raise PlanError(
            f"the config's model needs {needed / 2**30:.1f} GiB of fp32 weights to build, the "
            f"host has {available / 2**30:.1f} GiB available (every field a config leaves out "
            "takes its model type's default size)"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return auto.from_config(config, dtype=torch.float32).train()


class Initialization:
    """A fresh model's initial values as transformers' ``initialize_weights`` gives them, made
    one module at a time when zerocc asks (a ``WeightSource``, see
    :func:`zerocc.compiler.materialize.use_weights`).

    For a module, its tensors on ``meta`` are given storage, then the ``_init_weights`` of the
    module and of each of its ancestors run (:func:`_initialize_chain`: what
    ``initialize_weights`` does to those tensors, a parent's initialization of a child's weight
    included, as GPT-2 scales its residual projections from ``GPT2Attention``). Seeded from
    ``seed`` and the module's name: the same on every rank and at every world size (not the
    values ``from_config`` draws from one stream for the whole model)."""

    def __init__(self, net: nn.Module, seed: int) -> None:
        self.net, self.seed = net, seed
        self.aliases = _aliases(net)
        self.names = {name for name in self.aliases if _tensor(net, name).is_meta}
        self._owner: str | None = None
        self._values: dict[str, torch.Tensor] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def read(self, name: str) -> torch.Tensor:
        """The initial value of tensor ``name`` (its module's, made when first asked)."""
        owner = name.rpartition(".")[0]
        if owner != self._owner:
            self._values, self._owner = {}, None  # the last module's go first
            values, unset = self._made(owner)
            if unset:
                raise CaptureError(
                    f"transformers' initialization of {owner or '<root>'} "
                    f"({type(self.net.get_submodule(owner)).__name__}) leaves {_shown(unset)} "
                    "unset: no value to start from"
                )
            self._values, self._owner = values, owner
        return self._values[name]

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name``, flattened."""
        return self.read(name).reshape(-1)[start:stop]

    def describe(self) -> str:
        """One line for explain()."""
        return (f"initial weights made by transformers' initialization, module by module "
                f"(seed {self.seed})")  # fmt: skip

    def fingerprint(self) -> str:
        """The seed, and the transformers release whose initialization makes the values."""
        import transformers

        return f"transformers {transformers.__version__}'s initialization, seed {self.seed}"

    def uncovered(self) -> list[str]:
        """The tensors initialization leaves unset in one module of each kind (those of a
        kind are initialized alike): its smallest, unless that holds more than
        ``_LARGEST_TRIED`` elements (a 70B model's embedding would take 4 GiB even where
        nothing is trained, in ``zerocc estimate``; such a kind is checked as zerocc builds it)."""
        sizes: dict[str, int] = {}
        for name in self.names:
            owner = name.rpartition(".")[0]
            sizes[owner] = sizes.get(owner, 0) + _tensor(self.net, name).numel()
        smallest: dict[type, str] = {}
        for owner in sorted(sizes, key=lambda o: (sizes[o], o)):
            smallest.setdefault(type(self.net.get_submodule(owner)), owner)
        tried = [o for o in smallest.values() if sizes[o] <= _LARGEST_TRIED]
        return [name for owner in tried for name in self._made(owner)[1]]

    def _made(self, owner: str) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The values of ``owner``'s meta tensors and the names left unset; the module keeps
        its meta tensors."""
        module = self.net.get_submodule(owner)
        own = [*module._parameters.items(), *module._buffers.items()]
        names = [_full(owner, n) for n, t in own if t is not None and t.is_meta]
        # The own tensors of the modules given storage, to put back (a tied tensor's other
        # names are given it too).
        owners = {a.rpartition(".")[0] for n in names for a in self.aliases[n]}
        kept = {
            m: (dict(m._parameters), dict(m._buffers)) for m in map(self.net.get_submodule, owners)
        }
        try:
            chain = partial(_initialize_chain, self.net, owner)
            seed = module_seed(self.seed, owner)
            unset = _initialize(self.net, names, seed, self.aliases, chain)
            return {n: _tensor(self.net, n).detach() for n in names}, unset
        finally:
            for m, (parameters, buffers) in kept.items():
                m._parameters.update(parameters)
                m._buffers.update(buffers)


def _auto_model(transformers: Any, auto_class: str) -> Any:
    """``transformers.<auto_class>``; PlanError unless it is an Auto class."""
    auto = getattr(transformers, auto_class, None)
    if not hasattr(auto, "from_config"):
        raise PlanError(f"{auto_class}: not one of transformers' Auto classes (e.g. "
                        "AutoModelForCausalLM, AutoModelForSequenceClassification)")  # fmt: skip
    return auto


def _on_meta(auto: Any, config: Any) -> nn.Module:
    with torch.device("meta"):
        net = auto.from_config(config, dtype=torch.float32)
    return net.train()  # from_config's mode; from_pretrained's is eval (dropout off)


def _whole_pretrained(auto: Any, folder: Path, overrides: dict[str, Any], why: str) -> nn.Module:
    warnings.warn(
        f"{why}; loading {folder} with transformers' from_pretrained, the whole model in fp32 "
        "on each rank's host",
        stacklevel=3,
    )
    net = auto.from_pretrained(folder, local_files_only=True, dtype=torch.float32, **overrides)
    return net.train()


def _initialize(
    net: nn.Module,
    names: list[str],
    seed: int,
    aliases: dict[str, list[str]],
    initialize: Callable[[], None],
) -> list[str]:
    """Give the meta tensors ``names`` storage (under every name, ``aliases``) and the values
    the model's own initialization gives them: ``initialize``, ``initialize_weights`` or
    :func:`_initialize_chain`, whose ``_init_weights`` leave tensors still on ``meta`` as they
    are, from ``seed``. Returns those it left unset: each starts as a value no initialization
    gives (NaN, or the integer dtype's largest), and one still holding it was not initialized."""
    if not names:
        return []
    for name in names:
        meta = _tensor(net, name)
        if meta.dtype == torch.bool:
            return [name]  # no value tells an unset bool
        unset = torch.nan if meta.dtype.is_floating_point else torch.iinfo(meta.dtype).max
        value = torch.full(meta.shape, unset, dtype=meta.dtype)
        if isinstance(meta, nn.Parameter):
            value = nn.Parameter(value, requires_grad=meta.requires_grad)
        for alias in aliases[name]:
            owner, _, leaf = alias.rpartition(".")
            module = net.get_submodule(owner)
            kind = "_parameters" if leaf in module._parameters else "_buffers"
            getattr(module, kind)[leaf] = value
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        initialize()
    return [name for name in names if _holds_unset(_tensor(net, name))]


def _aliases(net: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter and buffer (a tied one has several), by each name."""
    described = describe_model(net)
    infos = [*described.params, *described.buffers]
    return {name: list(info.aliases) for info in infos for name in info.aliases}


def _initialize_all(net: nn.Module) -> None:
    """``initialize_weights``, every module's ``_init_weights`` (it skips those it has done)."""
    for module in net.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    net.initialize_weights()


def _initialize_chain(net: nn.Module, owner: str) -> None:
    """What ``initialize_weights`` does to module ``owner``'s own tensors, without walking the
    whole model: the ``_init_weights`` of ``owner``, then of each of its ancestors (a parent may
    initialize a child's weight; ``initialize_weights`` visits children before parents), each
    by the model it belongs to (a composite model's sub-model initializes its own modules)."""
    transformers = transformers_module()
    guard = getattr(getattr(transformers, "initialization", None), "guard_torch_init_functions",
                    contextlib.nullcontext)  # fmt: skip
    parts = owner.split(".") if owner else []
    chain = [".".join(parts[:i]) for i in range(len(parts), -1, -1)]  # owner first, root last
    with torch.no_grad(), guard():
        for fqn in chain:
            module = net.get_submodule(fqn)
            model = next(
                net.get_submodule(a) for a in chain[chain.index(fqn):]
                if isinstance(net.get_submodule(a), transformers.PreTrainedModel)
            )  # fmt: skip
            module.__dict__.pop("_is_hf_initialized", None)  # it skips modules it has done
            model._initialize_weights(module)


def _tensor(net: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(net.get_submodule(owner), leaf)


def _full(owner: str, name: str) -> str:
    return f"{owner}.{name}" if owner else name


def _holds_unset(value: torch.Tensor) -> bool:
    if value.dtype.is_floating_point:
        return bool(value.isnan().any())
    return bool((value == torch.iinfo(value.dtype).max).any())


def _shown(names: list[str]) -> str:
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")

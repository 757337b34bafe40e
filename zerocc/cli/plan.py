"""`zerocc plan check | schema | import | auto`, and the checks every command that reads a plan runs
before any rank starts (:func:`checked_plan`)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from zerocc.compiler.driver.session import ModelSplits
    from zerocc.compiler.workload import Workload

from zerocc.cli.plan_args import add_plan_arguments, plan_of
from zerocc.compiler.plan import OptimizerConfig, Plan, load_plan, plan_json_schema
from zerocc.errors import PlanError, PlanWarning, ZeroccError
from zerocc.runtime.launch import launched


def add_commands(commands: argparse._SubParsersAction) -> None:
    """`zerocc plan check | schema | import | auto`."""
    plan = commands.add_parser(
        "plan",
        help="check a plan file, search for the fastest plan that fits (auto), convert a "
        "DeepSpeed config (import), or print the plan schema",
    )
    plan.set_defaults(help_of=plan)
    plan_commands = plan.add_subparsers(title="commands", metavar="COMMAND")
    check = plan_commands.add_parser("check", help="validate a plan file and summarize it")
    add_plan_arguments(check)
    check.set_defaults(run=_check)
    schema = plan_commands.add_parser("schema", help="print the JSON Schema of plan files")
    schema.set_defaults(run=_schema)
    imported = plan_commands.add_parser(
        "import", help="convert a DeepSpeed config (ds_config.json) into a plan"
    )
    imported.add_argument("config", metavar="DS_CONFIG", help="path of a DeepSpeed JSON config")
    imported.add_argument("-o", "--output", metavar="PLAN", help="write the plan YAML here")
    imported.add_argument(
        "--overwrite", action="store_true", help="replace --output where it exists (else refused)"
    )
    imported.add_argument(
        "--workload", metavar="MODULE:FUNCTION", help="the plan's workload (DeepSpeed has none)"
    )
    imported.set_defaults(run=_import)
    auto = plan_commands.add_parser(
        "auto",
        help="search stages, recomputation and offload with the cost model for the fastest "
        "plan that fits",
    )
    add_plan_arguments(auto)
    auto.add_argument("--world-size", type=int, required=True, metavar="N", help="ranks")
    auto.add_argument(
        "--device", choices=("cpu", "cuda"),
        help="whose rates and memory (default: the plan's backend.device; auto: this machine's)",
    )  # fmt: skip
    auto.add_argument(
        "--memory", type=float, metavar="GIB",
        help=f"memory per rank in GiB (default: {CUDA_MEMORY_GIB:g} on cuda, an H100's; on cpu "
        "this machine's available memory shared by --ranks-per-node ranks)",
    )  # fmt: skip
    auto.add_argument(
        "--ranks-per-node", "--gpus-per-node", type=int, default=None, metavar="G",
        help="ranks per machine: tensor parallelism is searched within one, hybrid sharding "
        "across them, and on cpu they share its memory (default: every rank on one machine)",
    )  # fmt: skip
    auto.add_argument(
        "--calibration", "--rates", metavar="FILE",
        help="rates measured by `zerocc profile` (overrides plan.cost.calibration)",
    )  # fmt: skip
    auto.add_argument(
        "-o", "--output", metavar="PLAN",
        help="write the chosen plan here (default: PLAN's name with .auto.yaml, beside it)",
    )  # fmt: skip
    auto.add_argument(
        "--overwrite", action="store_true", help="replace the output file where it exists "
        "(else refused before the search)",
    )  # fmt: skip
    auto.add_argument(
        "--exhaustive", action="store_true",
        help="compile every candidate (default: skip those the cost model's orders rule out)",
    )  # fmt: skip
    auto.add_argument(
        "--pipelines", action="store_true",
        help="also try pipelines (parallel.pp 2, 4, 8 with 1f1b and zero-bubble): each compiles "
        "every pipeline rank, several times a candidate without one",
    )  # fmt: skip
    auto.add_argument(
        "--whole", action="store_true",
        help="compile every candidate at the model's depth (default: a model of 16 or more "
        "repeated blocks has its candidates drawn from copies cut to 4 and 6 blocks, and the "
        "pick compiled whole)",
    )  # fmt: skip
    auto.set_defaults(run=_auto)


CUDA_MEMORY_GIB = 80.0  # an H100's, what the built-in cuda rates describe


def memory_per_rank(device: str, gib: float | None, ranks_per_machine: int) -> int:
    """Bytes a rank has for a plan search: ``gib`` when given; on cuda an H100's (what the
    built-in rates describe); on cpu this machine's available memory over the ranks that share
    it."""
    from zerocc.runtime.machine_memory import host_available

    if gib is not None:
        if gib <= 0:
            raise ZeroccError(f"--memory {gib:g}: a positive number of GiB")
        return int(gib * 2**30)
    if device == "cuda":
        return int(CUDA_MEMORY_GIB * 2**30)
    return host_available() // max(ranks_per_machine, 1)


def _auto(args: argparse.Namespace) -> int:
    """`zerocc plan auto`: the fastest candidate plan that fits, written as a plan file."""
    from zerocc.cost.rates import rates_for
    from zerocc.inspect.plan_search import best_plan_yaml, search_plans

    plan = checked_plan(args)
    if plan.workload is None:
        raise ZeroccError(f"{args.plan}: plan auto compiles the plan's workload: it names none")
    if args.world_size < 1:
        raise ZeroccError(f"--world-size {args.world_size}: at least 1")
    output = Path(args.output) if args.output else Path(args.plan).with_suffix(".auto.yaml")
    if output.exists() and not args.overwrite:
        raise ZeroccError(f"{output}: exists; --overwrite replaces it, or name another -o")
    rates = rates_for(plan, args.device, args.calibration)
    memory = memory_per_rank(rates.device, args.memory, args.ranks_per_node or args.world_size)
    search = search_plans(plan, args.world_size, memory, rates, ranks_per_node=args.ranks_per_node,
                          exhaustive=args.exhaustive, pipelines=args.pipelines,
                          whole=args.whole)  # fmt: skip
    print(search.format())
    if search.best is None:
        return 2
    output.write_text(best_plan_yaml(search))
    print(f"wrote {output}")
    if plan.source and output.resolve().parent != Path(plan.source).resolve().parent:
        print(f"note: its workload ({plan.workload}) is found from its own folder, as a plan's "
              "is: move the module beside it, or name the workload by its file")  # fmt: skip
    return 0


def _check(args: argparse.Namespace) -> int:
    plan = checked_plan(args)
    model = checked_model(plan)[1] if plan.workload is not None else None
    print(f"{args.plan}: ok ({describe_plan(plan)}){model or ''}")
    if plan.workload is None:  # (a plan for zerocc.compile: fine, but not for `train`)
        print("note: no workload: `zerocc train` needs one (workload: 'module:function'); a "
              "plan given to zerocc.compile in Python does not")  # fmt: skip
    return 0


def checked_model(plan: Plan) -> tuple[nn.Module, str]:
    """Call the workload as a rank does (a model too large for this machine belongs on the
    meta device, where zerocc's examples build theirs) and check what the plan names in its
    model: units (classes, module globs, those kept gathered), the layers tensor parallelism
    splits, the experts expert parallelism splits and the layers float8 matmuls convert;
    for a pipeline, that its micro-batches divide the workload's first batch; under sequence
    parallelism, that the loss is no statistic of each tp rank's chunk of the sequence (the
    forward captured on the first batch, on fake tensors, as a rank captures it); PlanError
    naming the field otherwise. Returns the model and a few words on it. (`zerocc plan
    check`, and `zerocc train` before it launches any rank.)"""
    from zerocc.compiler.capture import describe_model
    from zerocc.compiler.driver.session import ModelSplits
    from zerocc.compiler.float8 import Float8Layers
    from zerocc.compiler.passes.partition import assign_units
    from zerocc.compiler.workload import load_workload

    workload = load_workload(plan)
    model = workload.model
    info = describe_model(model)
    units = plan.units
    found = assign_units(info, 1, units.classes, units.modules, units.min_mb,
                         blocks_per_unit=units.blocks_per_unit)  # fmt: skip
    splits = ModelSplits.of(model, info, plan)
    experts = splits.expert_parallel
    # (experts modules are units of their own under the mesh)
    _check_keep_gathered(plan, [u.key for u in found] + list(experts.modules if experts else ()))
    Float8Layers.chosen(model, plan)
    if plan.parallel.pp > 1 or plan.parallel.sequence_parallel:
        batch = _first_batch(plan, workload)
        if plan.parallel.pp > 1:
            _check_microbatches(plan, batch)
        if plan.parallel.sequence_parallel:
            _check_sequence_parallel_loss(plan, workload, splits, batch)
    elements = sum(p.numel for p in info.params)
    split = f"; {experts.describe()}" if experts is not None else ""
    described = f"{elements:,} parameters, {len(found)} units{split}"
    return model, f"; model {type(model).__name__}, {described}"


def _check_keep_gathered(plan: Plan, unit_names: list[str]) -> None:
    """That each ``units.keep_gathered`` pattern matches a unit (the shard pass refuses it
    in every rank, after the step is captured)."""
    from zerocc.compiler.names import glob_matches

    for pattern in plan.units.keep_gathered:
        if not any(glob_matches(name, pattern) for name in unit_names):
            raise PlanError(
                f"units.keep_gathered: pattern {pattern!r} matches no unit; units are: "
                f"{', '.join(unit_names[:6])}{', ...' if len(unit_names) > 6 else ''}"
            )


def _first_batch(plan: Plan, workload: Workload) -> tuple:
    """Rank 0's first batch, drawn for the fewest ranks the plan takes."""
    from zerocc.compiler.driver.session import plan_mesh
    from zerocc.inspect.estimate import first_batch

    mesh = plan_mesh(plan, plan.least_world_size())  # (plan check opens no session)
    return first_batch(workload, mesh.data_parallel)


def _check_sequence_parallel_loss(
    plan: Plan, workload: Workload, splits: ModelSplits, batch: tuple
) -> None:
    """That the loss is no statistic of each tp rank's chunk of the sequence (a mixture of
    experts' load-balancing loss): the loss captured on ``batch`` as a rank captures it,
    forward only (the check reads the loss, not its gradients), on fake tensors; PlanError
    naming ``parallel.sequence_parallel`` otherwise (a rank refuses it alike)."""
    import torch

    from zerocc.compiler.driver.program import capture_split

    capture_split(
        workload.model, splits.local, plan, workload.loss_fn, batch, torch.device("cpu"),
        training=False, tensor_parallel=splits.tensor_parallel,
        expert_parallel=splits.expert_parallel,
    )  # fmt: skip


def _check_microbatches(plan: Plan, batch: tuple) -> None:
    """That ``pipeline.microbatches`` divide rank 0's first ``batch``, as each pipeline rank
    cuts its batches; PlanError naming the field and the batch's shapes otherwise (a rank's
    own check says BatchError: there it is the batch that does not fit)."""
    from zerocc.errors import BatchError
    from zerocc.runtime.pipeline import microbatches_of

    try:
        microbatches_of(batch, plan.pipeline.microbatches_of(plan.parallel.pp))
    except BatchError as exc:
        raise PlanError(str(exc)) from None


def checked_plan(args: argparse.Namespace) -> Plan:
    """The command's plan (its file, the command line's `--set`), loaded and checked where it
    can be before any model is built: its `passes` against the passes' contracts, its backend
    among the registered ones, its workload importable (not called), and on this machine an
    NVMe offload folder must exist and take files. The plan's own errors come first, before
    torch is imported (seconds)."""
    plan = plan_of(args)
    from zerocc.backends import get_backend
    from zerocc.compiler.driver.pass_manager import check_passes
    from zerocc.cost.rates import check_calibration

    check_passes(plan)
    get_backend(plan.backend.name)
    if plan.workload is not None and not launched():  # (the launcher checked it for the ranks)
        from zerocc.compiler.workload import workload_function

        workload_function(plan)
    if plan.offload.uses_nvme:
        from zerocc.runtime.nvme import check_folder

        check_folder(Path(plan.offload.nvme_path))
    _check_dump_folder(plan, getattr(args, "dump", None))
    profiles = getattr(getattr(args, "run", None), "__name__", "") == "_profile"
    if not profiles:  # (profile writes the calibration, and reads none)
        check_calibration(plan)
    steps = getattr(args, "steps", None)
    resumes = getattr(args, "resume", None) or plan.checkpoint.resume
    if hasattr(args, "resume") and steps and not resumes and not launched():  # `zerocc train`
        warn_if_the_run_trains_nothing(plan, steps)
    return plan


# A run whose every rate is below this share of its schedule's peak moves its weights by a
# millionth of what one step at the peak would: a schedule longer than the run by as much.
NEGLIGIBLE_RATE = 1e-6


def warn_if_the_run_trains_nothing(plan: Plan, steps: int) -> None:
    """A PlanWarning when the learning rates the schedule gives the first ``steps`` optimizer
    steps are all below a millionth of its peak (0 included: a warmup's first step): the run
    trains next to nothing, though every field is in its range (``warmup_steps: 1e8`` with
    ``--steps 100``). A warning, not an error: a short trial run of a long recipe is one."""
    from zerocc.compiler.schedule import lr_at

    optimizer = plan.optimizer
    schedule = optimizer.schedule
    # Warmups rise and decays fall: the run's largest rate is at its last step or where its
    # warmup ends (DeepSpeed's steps are one behind: both sides of it).
    ends = (schedule.warmup_steps, schedule.warmup_num_steps, schedule.warmup_num_steps + 1)
    candidates = {0, steps - 1, *(step for step in ends if step < steps)}
    largest = max(lr_at(optimizer, step) for step in candidates)
    if largest < NEGLIGIBLE_RATE * optimizer.peak_lr:
        warnings.warn(
            f"optimizer.schedule: over its {steps} step(s) this run's learning rate reaches at "
            f"most {largest:.3g}, under a millionth of the schedule's peak {optimizer.peak_lr:g} "
            f"({optimizer.schedule.name}: {_schedule_fields(optimizer)}): it trains next to "
            "nothing; run more steps (--steps) or shorten the warmup",
            PlanWarning,
            stacklevel=2,
        )


def _schedule_fields(optimizer: OptimizerConfig) -> str:
    """The schedule's own fields as ``name value`` pairs."""
    schedule = optimizer.schedule
    return ", ".join(f"{name} {getattr(schedule, name)}" for name in schedule.fields())


def _check_dump_folder(plan: Plan, flag: str | None) -> None:
    """That the folder the dumps go to (``--dump``, else ZEROCC_DUMP_DIR or ``dumps.dir``)
    takes them, when there is one."""
    from zerocc.inspect.dumps import check_dump_folder, dump_dir, dump_dir_named

    if flag:
        check_dump_folder(Path(flag), "--dump")
    elif (root := dump_dir(plan)) is not None:
        check_dump_folder(root, dump_dir_named(plan))


def _import(args: argparse.Namespace) -> int:
    """Print what every key of a DeepSpeed config became; write the plan when every key
    converts (exit 2, listing them, when some are not supported)."""
    import yaml

    from zerocc.compiler.plan.deepspeed import convert, read_json
    from zerocc.compiler.plan.messages import plan_origin

    if args.output and Path(args.output).exists() and not args.overwrite:
        raise ZeroccError(f"{args.output}: exists; --overwrite replaces it, or name another -o")
    config = read_json(Path(args.config), plan_origin(args.config))
    if not isinstance(config, dict):
        raise ZeroccError(f"{args.config}: a DeepSpeed config is a JSON object")
    plan, outcomes = convert(config)
    unsupported = [o for o in outcomes if o.kind == "unsupported"]
    if unsupported:
        for outcome in outcomes:
            print(outcome.line())
        print(f"\n{args.config}: {len(unsupported)} option(s) zerocc does not support "
              "(above); no plan written", file=sys.stderr)  # fmt: skip
        return 2  # (as every error of the command line)
    if args.workload:
        plan["workload"] = args.workload
    # DeepSpeed gathers parameter by parameter; a zerocc unit is a module: its layers
    auto_units = plan.get("zero", {}).get("stage") == 3 and "units" not in plan
    if auto_units:
        plan["units"] = "auto"
    checked = load_plan(plan)  # what zerocc makes of it, checked as any plan
    fields = checked.model_dump(mode="json")
    for outcome in outcomes:  # an 'auto' left to zerocc: the value its default gives
        line = outcome.line()
        if outcome.default_of is not None:
            value = functools.reduce(lambda d, k: d[k], outcome.default_of.split("."), fields)
            line = line.removesuffix(")") + f": {json.dumps(value)})"
        print(line)
    mapped = sum(o.kind == "mapped" for o in outcomes)
    print(f"\n{len(outcomes)} option(s): {mapped} mapped, {len(outcomes) - mapped} without "
          f"meaning for zerocc; plan: {describe_plan(checked)}")  # fmt: skip
    if auto_units:
        print(f"note: {AUTO_UNITS_NOTE}")
    if args.output:
        header = (
            f"# Converted from the DeepSpeed config {args.config} by `zerocc plan import`.\n"
            "# Options without meaning for zerocc are listed by that command, not here.\n"
        )
        if not args.workload:
            header += "# workload: 'module:function'  (set yours: the model, loss and data)\n"
        if auto_units:
            header += f"# units: auto: {AUTO_UNITS_NOTE}\n"
        Path(args.output).write_text(header + yaml.safe_dump(plan, sort_keys=False))
        print(f"wrote {args.output}")
    return 0


AUTO_UNITS_NOTE = (
    "units: auto: each of the model's repeated blocks (its layers) is a unit, gathered one at "
    "a time (DeepSpeed gathers parameter by parameter); units.classes names others"
)


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(plan_json_schema(), indent=2))
    return 0


def describe_plan(plan: Plan) -> str:
    """A one-line summary of a plan: stage, passes, units, optimizer, workload."""
    from zerocc.compiler.driver.pass_manager import pass_names

    passes = pass_names(plan)
    units = [
        f"class {c}" if c != "auto" else "auto (the repeated block)" for c in plan.units.classes
    ]
    units += [f"modules {m}" for m in plan.units.modules]
    if plan.units.min_mb is not None:
        units.append(f">= {plan.units.min_mb} MB")
    opt = plan.optimizer
    parts = [
        f"stage {plan.zero.stage}",
        f"{len(passes)} passes ({' -> '.join(passes)})" if passes else "no passes",
        f"units: {', '.join(units) or 'whole model'}",
        describe_precision(plan),
        f"{opt.name} lr {opt.lr:g}"
        + (f" ({opt.schedule.name} schedule)" if opt.schedule.name != "constant" else "")
        + (f" clip {opt.grad_clip:g}" if opt.grad_clip else ""),
        f"workload {plan.workload or 'none'}",
    ]
    return ", ".join(parts)


def describe_precision(plan: Plan) -> str:
    p = plan.precision
    if not p.mixed:
        return "fp32"
    scaling = "no loss scaling" if p.scaling == "none" else f"{p.scaling} loss scaling"
    return f"{p.param} compute, {p.reduce} reduce, {p.master} master, {scaling}"

"""``zerocc export CHECKPOINT``: a checkpoint's model written as one file (safetensors or
``torch.save``), with the model's config and tokenizer beside it in a folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from zerocc.errors import ZeroccError
from zerocc.ir.quantities import human_bytes


def add_commands(commands: argparse._SubParsersAction) -> None:
    """`zerocc export CHECKPOINT` and its options."""
    export = commands.add_parser(
        "export", help="write a checkpoint's model as one file (safetensors or torch.save)"
    )
    export.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="a checkpoint, or a folder of them (its newest)"
    )
    export.add_argument(
        "--format", choices=["safetensors", "torch"], default="safetensors",
        help="safetensors (default: streamed, one tensor in memory at a time, no code on "
        "load) or torch (torch.save; the whole model in memory)",
    )  # fmt: skip
    export.add_argument(
        "-o", "--output", metavar="FILE", required=True,
        help="file to write; a folder gets model.safetensors / pytorch_model.bin, the names "
        "Hugging Face's from_pretrained reads (with the model's config.json beside them)",
    )  # fmt: skip
    export.add_argument(
        "--tokenizer", metavar="DIR",
        help="copy this tokenizer folder's files beside the model (with a folder --output; "
        "default: the tokenizer, or model folder, the run's plan named)",
    )  # fmt: skip
    export.add_argument(
        "--overwrite", action="store_true",
        help="replace the model file (and config.json) where --output holds them (else refused)",
    )  # fmt: skip
    export.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    """`zerocc export`: write the model file, and the tokenizer's files beside it."""
    from zerocc.runtime.checkpoint.export import copy_tokenizer, export_model

    written = export_model(args.checkpoint, args.output, args.format, args.overwrite)
    print(f"{written}: {human_bytes(written.stat().st_size)}")
    if written.name != Path(args.output).name:  # (written into a folder: a model's folder)
        source, copied = copy_tokenizer(args.checkpoint, written.parent, args.tokenizer)
        if copied:
            print(f"tokenizer: {', '.join(p.name for p in copied)} from {source}")
    elif args.tokenizer:
        raise ZeroccError("--tokenizer: needs a folder --output (the files go beside the model)")
    return 0

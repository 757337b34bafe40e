"""Ready workloads for Hugging Face models: `zerocc train` fine-tunes one without a workload
of your own.

    workload: "zerocc.workloads.huggingface:causal_lm"
    workload_args: {model: path/to/model, data: train.jsonl, seq_len: 2048, batch_size: 4}

``model`` is a local folder (with weights: :func:`pretrained`, ``from_pretrained``'s model;
else its config.json with fresh weights from ``seed``) or a config as a dict (``model_type``
and its fields). Either way the model is built on ``meta`` and zerocc reads or makes each
unit's weights as it shards them (:mod:`zerocc.workloads.hf_models`). ``tokenizer`` is a
local tokenizer folder (default: the model's folder). ``data`` is a local file: ``.jsonl``
(one document per line, its ``text_field``) or text (documents separated by blank lines).
Relative paths are read from the plan's folder. Nothing is downloaded.

Causal LMs: every document is tokenized once, an end-of-text token appended, and the stream
packed into sequences of ``seq_len`` tokens (Hugging Face's ``run_clm`` ``group_texts``; the
tail that fills no sequence is dropped); labels are the inputs (the model shifts them).
Sequence classification: one document per sequence, truncated and padded to ``seq_len``, with
its label (``label_field``: an int, or strings numbered in sorted order).

The last ``eval_fraction`` of the sequences is held back (``Workload.eval_batches``, for
`zerocc train --eval-every`). Each epoch shuffles the rest with ``seed`` + epoch and deals each
step's ``batch_size`` × ranks sequences out, rank r taking the r-th slice (DistributedSampler's
split, every rank different data, tail dropped so all ranks take the same number of steps);
``epochs`` (default 1; null: without end) bounds the data.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerocc.compiler.workload import Workload, plan_relative
from zerocc.errors import CheckpointError, PlanError
from zerocc.runtime.checkpoint.weight_files import NAMES
from zerocc.workloads.hf_models import fresh, pretrained
from zerocc.workloads.hf_models import transformers_module as _transformers

__all__ = ["causal_lm", "pretrained", "sequence_classification"]


def causal_lm(
    model: str | dict[str, Any],
    data: str,
    tokenizer: str | None = None,
    seq_len: int = 512,
    batch_size: int = 8,
    text_field: str = "text",
    eval_fraction: float = 0.0,
    epochs: int | None = 1,
    seed: int = 0,
) -> Workload:
    """A causal LM (``AutoModelForCausalLM``) trained on packed sequences of ``data``."""
    transformers = _transformers()
    tok = _tokenizer(transformers, model, tokenizer)
    net = _model(transformers.AutoModelForCausalLM, transformers, model, seed)
    _check_vocab(net, tok)
    ids = _pack(_tokenized(tok, _documents(data, text_field)), seq_len, data)
    train, held = _split(ids, eval_fraction, data)

    def loss_fn(m: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        # (no KV cache: training reads none, and each layer writing one would keep capture
        # from tracing the decoder layers once, zerocc.compiler.repeats)
        return m(input_ids=input_ids, labels=input_ids, use_cache=False).loss

    return Workload(
        net,
        loss_fn=loss_fn,
        batches=_dealer((train,), batch_size, epochs, seed, data),
        eval_batches=_evaluation((held,), batch_size) if len(held) else None,
        tokens_per_batch=lambda batch: batch[0].numel(),
    )


def sequence_classification(
    model: str | dict[str, Any],
    data: str,
    tokenizer: str | None = None,
    num_labels: int | None = None,
    seq_len: int = 128,
    batch_size: int = 8,
    text_field: str = "text",
    label_field: str = "label",
    eval_fraction: float = 0.0,
    epochs: int | None = 1,
    seed: int = 0,
) -> Workload:
    """A sequence classifier (``AutoModelForSequenceClassification``) on labelled JSONL."""
    transformers = _transformers()
    tok = _tokenizer(transformers, model, tokenizer)
    rows = _rows(data, (text_field, label_field))
    names = sorted({r[label_field] for r in rows}, key=str)
    number = {name: i for i, name in enumerate(names)}
    if all(isinstance(n, int) for n in names):
        number = {n: n for n in names}
    labels = torch.tensor([number[r[label_field]] for r in rows])
    count = num_labels or int(labels.max()) + 1
    if int(labels.max()) >= count:
        raise PlanError(f"workload_args.num_labels: {count}, but {data} holds labels {names}")
    if tok.pad_token is None:  # GPT-2-like tokenizers: pad with end-of-text, as is usual
        tok.pad_token = tok.eos_token
    encoded = tok(
        [r[text_field] for r in rows],
        truncation=True,
        max_length=seq_len,
        padding="max_length",
        return_tensors="pt",
    )
    overrides = {"num_labels": count, "pad_token_id": tok.pad_token_id}
    auto = transformers.AutoModelForSequenceClassification
    net = _model(auto, transformers, model, seed, overrides)
    _check_vocab(net, tok)
    tensors = (encoded["input_ids"], encoded["attention_mask"], labels)
    train, held = zip(*(_split(t, eval_fraction, data) for t in tensors), strict=True)

    def loss_fn(m: nn.Module, input_ids, attention_mask, labels) -> torch.Tensor:
        return m(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    return Workload(
        net,
        loss_fn=loss_fn,
        batches=_dealer(train, batch_size, epochs, seed, data),
        eval_batches=_evaluation(held, batch_size) if len(held[0]) else None,
        tokens_per_batch=lambda batch: int(batch[1].sum()),
    )


# -- model and tokenizer ---------------------------------------------------------------------


def _folder(path: str, what: str) -> Path:
    folder = plan_relative(path)
    if not folder.is_dir():
        why = "nothing is downloaded: save it there first, e.g. with save_pretrained"
        raise PlanError(f"workload_args.{what}: {folder} is not a folder ({why})")
    return folder


def _tokenizer(transformers: Any, model: str | dict, tokenizer: str | None) -> Any:
    if tokenizer is None:
        if not isinstance(model, str):
            raise PlanError(
                "workload_args.tokenizer: a model given as a config needs a tokenizer folder"
            )
        tokenizer = model
    folder = _folder(tokenizer, "tokenizer")
    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise PlanError(f"workload_args.tokenizer: {folder} holds no tokenizer: {exc}") from None


def _model(
    auto: Any,
    transformers: Any,
    model: str | dict,
    seed: int,
    overrides: dict[str, Any] | None = None,
) -> nn.Module:
    """The model, in fp32, on ``meta`` (zerocc reads or makes each unit's weights as it
    shards them): a folder's weights when it has them (:func:`pretrained`), else fresh weights
    from ``seed`` (``hf_models.fresh``; the same on every rank)."""
    overrides = overrides or {}
    try:
        if isinstance(model, dict):
            fields = dict(model)
            kind = fields.pop("model_type", None)
            if kind is None:
                raise PlanError("a config needs model_type (e.g. llama, gpt2)")
            try:
                config = transformers.AutoConfig.for_model(kind, **fields, **overrides)
            except (ValueError, TypeError) as exc:
                raise PlanError(f"{exc}") from None
            return fresh(auto, config, seed)
        folder = _folder(model, "model")
        if any((folder / name).exists() for name in NAMES):
            return pretrained(folder, auto.__name__, seed, **overrides)
        if not (folder / "config.json").exists():
            raise PlanError(f"{folder} holds neither weights nor config.json")
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True, **overrides)
        return fresh(auto, config, seed)
    except (PlanError, CheckpointError) as exc:
        message = f"{exc}"
        if not message.startswith("workload_args."):
            message = f"workload_args.model: {message}"
        raise PlanError(message) from None


def _check_vocab(model: nn.Module, tokenizer: Any) -> None:
    size = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > size:
        raise PlanError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding {size}: ids "
            f"beyond {size - 1} would index past it; use a config with vocab_size >= "
            f"{len(tokenizer)} or the model's own tokenizer"
        )


# -- data ------------------------------------------------------------------------------------


def _documents(data: str, text_field: str) -> list[str]:
    path = plan_relative(data)
    if path.suffix == ".jsonl":
        return [row[text_field] for row in _rows(data, (text_field,))]
    text = _read(path)
    docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    if not docs:
        raise PlanError(f"workload_args.data: {path} holds no text")
    return docs


def _rows(data: str, fields: tuple[str, ...]) -> list[dict[str, Any]]:
    path = plan_relative(data)
    rows = []
    for number, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PlanError(f"workload_args.data: {path} line {number}: not JSON: {exc}") from None
        missing = [f for f in fields if not isinstance(row, dict) or f not in row]
        if missing:
            where = f"workload_args.data: {path} line {number}"
            raise PlanError(f"{where} has no {missing[0]!r} field (name it in workload_args)")
        rows.append(row)
    if not rows:
        raise PlanError(f"workload_args.data: {path} holds no rows")
    return rows


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise PlanError(f"workload_args.data: {path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"workload_args.data: {path} cannot be read: {exc}") from None


def _tokenized(tokenizer: Any, docs: list[str]) -> list[int]:
    """Every document's ids, each followed by the end-of-text token (when the tokenizer has
    one): the stream sequences are cut from, so no sequence reads two documents as one."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        stream += ids + eos
    return stream


def _pack(stream: list[int], seq_len: int, data: str) -> torch.Tensor:
    count = len(stream) // seq_len
    if count == 0:
        raise PlanError(
            f"workload_args.data: {data} holds {len(stream)} tokens, fewer than one "
            f"sequence of seq_len {seq_len}"
        )
    return torch.tensor(stream[: count * seq_len]).view(count, seq_len)


def _split(rows: torch.Tensor, fraction: float, data: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, the held-back last ``fraction`` of them)."""
    if not 0 <= fraction < 1:
        raise PlanError(f"workload_args.eval_fraction: {fraction}; allowed: 0 <= it < 1")
    held = round(len(rows) * fraction)
    if fraction and held == 0:
        raise PlanError(
            f"workload_args.eval_fraction: {fraction} of {data}'s {len(rows)} "
            "sequences holds none back; raise it or give more data"
        )
    return rows[: len(rows) - held], rows[len(rows) - held :]


def _dealer(
    tensors: tuple[torch.Tensor, ...], batch_size: int, epochs: int | None, seed: int, data: str
) -> Callable[[int, int], Iterator[tuple]]:
    """``batches(rank, world_size)``: each step's ``batch_size`` × ranks rows of a seeded
    per-epoch permutation, rank r taking the r-th slice; the tail that fills no step dropped."""

    def batches(rank: int, world_size: int) -> Iterator[tuple]:
        rows, step = len(tensors[0]), batch_size * world_size
        if rows < step:
            takes = f"{batch_size} per rank x {world_size} ranks"
            raise PlanError(
                f"workload_args.data: {data} gives {rows} training sequences, fewer than one "
                f"step takes ({takes})"
            )
        epoch = 0
        while epochs is None or epoch < epochs:
            order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed + epoch))
            for start in range(0, rows - step + 1, step):
                mine = order[start + rank * batch_size : start + (rank + 1) * batch_size]
                yield tuple(t[mine] for t in tensors)
            epoch += 1

    return batches


def _evaluation(
    tensors: tuple[torch.Tensor, ...], batch_size: int
) -> Callable[[int, int], Iterator[tuple]]:
    """``eval_batches(rank, world_size)``: the held-back rows dealt to the ranks in turn, the
    same number to each (every rank evaluates batches of the same shapes, together)."""

    def batches(rank: int, world_size: int) -> Iterator[tuple]:
        dealt = len(tensors[0]) - len(tensors[0]) % world_size
        mine = torch.arange(rank, dealt, world_size)
        for start in range(0, len(mine), batch_size):
            chosen = mine[start : start + batch_size]
            yield tuple(t[chosen] for t in tensors)

    return batches

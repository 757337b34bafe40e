"""Small models for what sharding gets wrong: ties, frozen parts, reuse, buffers, unused
parameters, odd sizes.

Each entry of ``MODELS`` builds a model deterministically and makes rank-local batches, so a
worker process and the reference in the test process build the same thing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from model import GPT, GPTConfig
from torch import nn


class FrozenBackbone(nn.Module):
    """A frozen feature extractor under a trainable head (the LoRA/PEFT shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16))
        self.backbone.requires_grad_(False)
        self.adapter = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.backbone(x)
        h = h + self.adapter(h)
        return F.cross_entropy(self.head(h), y)


class CalledTwice(nn.Module):
    """One block applied twice, with another block in between."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Sequential(nn.Linear(10, 10), nn.GELU())
        self.middle = nn.Sequential(nn.Linear(10, 10), nn.Tanh())
        self.out = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.shared(self.middle(self.shared(x)))
        return F.cross_entropy(self.out(x), y)


class WithBuffers(nn.Module):
    """A persistent buffer (a fixed scale) and a non-persistent one (a mask) in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(8, 8)
        self.lin2 = nn.Linear(8, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("mask", (torch.arange(8) % 3 != 0).float(), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin1(x)) * self.scale * self.mask
        return F.mse_loss(self.lin2(h), y)


class OddSizes(nn.Module):
    """Parameter sizes that no world size above one divides (7×5, 5, 13×7, 13, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 13)
        self.c = nn.Linear(13, 1)
        self.gain = nn.Parameter(torch.tensor([1.0, 0.5, 2.0]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))  # (B, 1)
        return F.mse_loss(h * self.gain.sum(), y)


class UnusedInUnit(nn.Module):
    """A parameter the loss never reaches (an unused pooler) in a unit with ones it does."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 9), nn.Tanh())
        self.pooler = nn.Linear(9, 9)  # never called: torch.optim skips it, so must zerocc
        self.head = nn.Linear(9, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.body(x)), y)


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))


# The example GPT split as Megatron splits it (tensor parallelism, ``parallel.tp_layers``): the
# fused q/k/v projection and the MLP's up-projection colwise (whole heads per rank), the
# attention's and MLP's output projections rowwise, the embedding and the output head tied to it
# by vocabulary.
GPT_TP_LAYERS = {
    "transformer.h.*.attn.c_attn": {"style": "colwise", "fused": 3},
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
    "transformer.wte": "vocab",
    "lm_head": "vocab",
}


def tiny_gpt_4_heads() -> GPT:
    """The tiny GPT with 4 heads of 4 features, so that 4 tensor-parallel ranks split it."""
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16))


def tiny_gpt_4_layers() -> GPT:
    """The tiny GPT with 4 blocks, to cut into up to 4 pipeline stages."""
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16))


def tiny_gpt_dropout() -> GPT:
    """The tiny GPT with dropout after the embeddings, in attention and on both residuals."""
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1))


def _gpt_batch(step: int, rank: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 32, (batch, 8), generator=g)
    return x, torch.randint(0, 32, (batch, 8), generator=g)


def _features(n_in: int, target: Callable[[torch.Generator, int], torch.Tensor]):
    def batch(step: int, rank: int, size: int = 4):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(size, n_in, generator=g), target(g, size)

    return batch


# name -> (build, batch(step, rank), units section)
MODELS = {
    "gpt": (tiny_gpt, _gpt_batch, {"classes": ["Block"]}),
    "frozen": (
        FrozenBackbone,
        _features(12, lambda g, n: torch.randint(0, 5, (n,), generator=g)),
        {"modules": ["backbone", "adapter"]},
    ),
    "twice": (
        CalledTwice,
        _features(10, lambda g, n: torch.randint(0, 3, (n,), generator=g)),
        {"modules": ["shared", "middle"]},
    ),
    "buffers": (
        WithBuffers,
        _features(8, lambda g, n: torch.randn(n, 4, generator=g)),
        {"modules": ["lin1"]},
    ),
    "unused": (
        UnusedInUnit,
        _features(6, lambda g, n: torch.randint(0, 2, (n,), generator=g)),
        {"modules": ["body"]},
    ),
    "odd": (
        OddSizes,
        _features(5, lambda g, n: torch.randn(n, 1, generator=g)),
        {"modules": ["a", "b"]},
    ),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return entry(name)[0]()


# Models whose forward draws random numbers, as MODELS entries. Not in MODELS: the parity matrix
# holds every entry of it against one process training on all ranks' batches, which draws other
# numbers; a run of one of these is compared with another run of itself (recompute on and off).
RANDOM_MODELS = {"gpt_dropout": (tiny_gpt_dropout, _gpt_batch, {"classes": ["Block"]})}


# -- kinds of models zerocc once failed to compile (issue 15) -------------------------------------


class MeanSquare(nn.Module):
    """The loss as the last child of an ``nn.Sequential``: drive the outputs to zero."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.pow(2).mean()


def numbered() -> nn.Sequential:
    """An ``nn.Sequential`` at the root whose numbered children are units ("0", "2"), and one
    nested in it ("3.0", "3.1"): unit names, and so state keys, that start with a digit."""
    nested = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nested, MeanSquare())


# Keys a Python argument cannot be named by as they are: a keyword, a builtin, '-', a space, a
# non-ASCII letter, and two that read the same once made identifiers ('a-b', 'a_b').
AWKWARD_KEYS = ("if", "print", "a-b", "a_b", "é x")


class AwkwardKeys(nn.Module):
    """Units under ``nn.ModuleDict`` keys that are no Python identifiers."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({k: nn.Linear(6, 6) for k in AWKWARD_KEYS})
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = torch.tanh(block(x))
        return F.cross_entropy(self.head(x), y)


class Recurrent(nn.Module):
    """A recurrent layer (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) read at its last time step."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn
        width = rnn.hidden_size * (2 if rnn.bidirectional else 1)
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)  # (B, T, width)
        return F.mse_loss(self.head(out[:, -1]), y)


def _recurrent(kind: type[nn.Module], **options):
    def build_recurrent() -> Recurrent:
        return Recurrent(kind(3, 4, batch_first=True, **options))

    return build_recurrent


def _sequences(step: int, rank: int, size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 5, 3, generator=g), torch.randn(size, 2, generator=g)


def _inputs(step: int, rank: int, size: int = 4) -> tuple[torch.Tensor]:
    """A batch of inputs alone (the model's loss needs no target)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(size, 6, generator=g),)


class LossAndLogits(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


class ReturnsContainer(nn.Module):
    """A classifier that returns its loss inside ``wrap(loss, logits)``, as Hugging Face models
    do: a dict, a tuple with the loss first (``return_dict=False``), a namedtuple."""

    def __init__(self, wrap: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.wrap = wrap

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        logits = self.head(self.body(x))
        return self.wrap(F.cross_entropy(logits, y), logits)


def _returns(wrap: Callable[[torch.Tensor, torch.Tensor], Any]):
    return lambda: ReturnsContainer(wrap)


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a model's output, read plainly for the references (zerocc finds it with its
    own default loss, which the parity tests hold to this)."""
    if isinstance(output, dict):
        return output["loss"]
    if isinstance(output, LossAndLogits):
        return output.loss
    if isinstance(output, tuple):
        return output[0]
    return output


_classes = _features(6, lambda g, n: torch.randint(0, 3, (n,), generator=g))
_rnn_units = {"modules": ["rnn"]}

# As MODELS entries, held against one process on 2 ranks at stages 0-3 by test_model_kinds_parity
# (one spawn), not in the whole matrix of test_parity (worlds 1-3 and their extras).
MODEL_KINDS = {
    "numbered": (
        numbered,
        _inputs,
        {"modules": ["0", "2", "3.0", "3.1"]},
    ),
    "awkward_keys": (
        AwkwardKeys,
        _classes,
        {"modules": [f"blocks.{k}" for k in AWKWARD_KEYS]},
    ),
    "lstm": (_recurrent(nn.LSTM), _sequences, _rnn_units),
    "lstm_deep": (_recurrent(nn.LSTM, num_layers=2, bidirectional=True), _sequences, _rnn_units),
    "gru": (_recurrent(nn.GRU), _sequences, _rnn_units),
    "rnn_tanh": (_recurrent(nn.RNN, nonlinearity="tanh"), _sequences, _rnn_units),
    "rnn_relu": (_recurrent(nn.RNN, nonlinearity="relu"), _sequences, _rnn_units),
    "returns_dict": (
        _returns(lambda loss, logits: {"loss": loss, "logits": logits}),
        _classes,
        {"modules": ["body"]},
    ),
    "returns_tuple": (
        _returns(lambda loss, logits: (loss, logits)),
        _classes,
        {"modules": ["body"]},
    ),
    "returns_namedtuple": (_returns(LossAndLogits), _classes, {"modules": ["body"]}),
}
# lstm_deep with dropout between its layers: random, so compared with itself across stages.
RANDOM_KINDS = {
    "lstm_dropout": (
        _recurrent(nn.LSTM, num_layers=2, bidirectional=True, dropout=0.5),
        _sequences,
        _rnn_units,
    )
}


class SmoothedLM(nn.Module):
    """Token embedding, a hidden layer and an untied output head, trained with label smoothing:
    a cross-entropy tensor parallelism's vocabulary-parallel loss does not compute, so the
    head's gathered logits feed it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.embed(x))))
        return F.cross_entropy(logits.view(-1, 32), y.view(-1), label_smoothing=0.1)


class CausalLM(nn.Module):
    """A tiny Hugging Face Llama trained on next-token prediction of its batch (the tokens are
    their own labels, shifted by the model). ``attention_dropout``: the config's dropout on
    the attention probabilities (transformers' own code draws it)."""

    def __init__(self, attention_dropout: float = 0.0) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=32,
                             attention_dropout=attention_dropout)  # fmt: skip
        self.lm = LlamaForCausalLM(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def _token_batch(step: int, rank: int, batch: int = 2) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randint(0, 64, (batch, 16), generator=g),)


# Megatron's split of a Llama decoder layer: q, k, v and the MLP's gate and up projections
# colwise (whole heads of q and of k/v per rank), the output projections rowwise, the
# embedding and output head by vocabulary.
LLAMA_TP_LAYERS = {
    "lm.model.layers.*.self_attn.[qkv]_proj": "colwise",
    "lm.model.layers.*.self_attn.o_proj": "rowwise",
    "lm.model.layers.*.mlp.[gu][ap]*_proj": "colwise",
    "lm.model.layers.*.mlp.down_proj": "rowwise",
    "lm.model.embed_tokens": "vocab",
    "lm.lm_head": "vocab",
}

# Mixtral's attention and vocabulary split as Llama's; its experts are not split (every tp rank
# runs them all on the whole sequence).
MIXTRAL_TP_LAYERS = {k: v for k, v in LLAMA_TP_LAYERS.items() if ".mlp." not in k}

# Models of the tensor-parallel tests, and the layers they split (``parallel.tp_layers``).
TP_MODELS = {
    "gpt4h": (tiny_gpt_4_heads, _gpt_batch, {"classes": ["Block"]}),
    "smoothed": (SmoothedLM, _gpt_batch, {"modules": ["embed", "mix", "head"]}),
    "llama": (CausalLM, _token_batch, {"classes": ["LlamaDecoderLayer"]}),
    # (random: compared with one process drawing by key)
    "llama_dropout": (
        functools.partial(CausalLM, attention_dropout=0.1),
        _token_batch,
        {"classes": ["LlamaDecoderLayer"]},
    ),
}
TP_LAYERS = {
    "gpt": GPT_TP_LAYERS,
    "gpt4h": GPT_TP_LAYERS,
    "gpt4": GPT_TP_LAYERS,  # (a pipeline's, tests/parity/test_pipeline_parity.py)
    "gpt_dropout": GPT_TP_LAYERS,  # dropout inside the split attention, drawn by key
    "gpt4_dropout": GPT_TP_LAYERS,
    "smoothed": {"embed": "vocab", "head": "vocab"},
    "llama": LLAMA_TP_LAYERS,
    "llama_dropout": LLAMA_TP_LAYERS,
    "mixtral": MIXTRAL_TP_LAYERS,
    "mixtral_grouped": MIXTRAL_TP_LAYERS,
    "mixtral_no_router_loss": MIXTRAL_TP_LAYERS,
}


class MoECausalLM(nn.Module):
    """A tiny Hugging Face mixture-of-experts causal LM (``kind``: Mixtral; Qwen2-MoE, with a
    shared expert; DeepSeek-V3, with many small experts, group-limited top-k routing and a
    dense first layer), its experts run by the library's ``experts_implementation`` ``impl``
    (``eager``: each expert's tokens found with ``nonzero``; ``grouped_mm``: tokens sorted by
    expert, one grouped matmul; ``batched_mm``: each token's experts' weights gathered, one
    batched matmul). The router's load-balancing loss is part of the loss (Mixtral
    and Qwen2-MoE, unless ``router_loss`` is False), with a coefficient large enough for its
    gradient to matter."""

    def __init__(self, kind: str, impl: str, router_loss: bool = True, layers: int = 2) -> None:
        super().__init__()
        import transformers as hf

        common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32)  # fmt: skip
        if kind == "mixtral":
            config = hf.MixtralConfig(**common, intermediate_size=48, num_local_experts=4,
                                      num_experts_per_tok=2, output_router_logits=True,
                                      router_aux_loss_coef=0.1)  # fmt: skip
            self.lm = hf.MixtralForCausalLM
        elif kind == "qwen_moe":
            config = hf.Qwen2MoeConfig(**common, intermediate_size=48, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=32, num_experts=4,
                                       num_experts_per_tok=2, output_router_logits=True,
                                       router_aux_loss_coef=0.1)  # fmt: skip
            self.lm = hf.Qwen2MoeForCausalLM
        else:
            config = hf.DeepseekV3Config(**common, intermediate_size=48, moe_intermediate_size=16,
                                         n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                         topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                                         q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                                         qk_nope_head_dim=4, v_head_dim=8)  # fmt: skip
            self.lm = hf.DeepseekV3ForCausalLM
        config._experts_implementation = impl
        config.output_router_logits = router_loss and kind != "deepseek"
        self.lm = self.lm(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def _moe(kind: str, impl: str) -> Callable[[], nn.Module]:
    return lambda: MoECausalLM(kind, impl)


_DECODER_LAYERS = {"mixtral": "Mixtral", "qwen_moe": "Qwen2Moe", "deepseek": "DeepseekV3"}
# Mixture-of-experts models by name: ``mixtral`` (eager experts), ``mixtral_grouped``
# (grouped_mm), ``mixtral_batched`` (batched_mm), ...; one FSDP unit per decoder layer.
MOE_MODELS = {
    f"{kind}{suffix}": (_moe(kind, impl), _token_batch, {"classes": [f"{cls}DecoderLayer"]})
    for kind, cls in _DECODER_LAYERS.items()
    for suffix, impl in (("", "eager"), ("_grouped", "grouped_mm"), ("_batched", "batched_mm"))
}
# Its experts token by token, no statistic of the tokens in the loss (what sequence
# parallelism can split)
MOE_MODELS["mixtral_no_router_loss"] = (
    lambda: MoECausalLM("mixtral", "grouped_mm", router_loss=False),
    _token_batch,
    {"classes": ["MixtralDecoderLayer"]},
)


# 4 decoder layers: a zero-bubble pipeline of 2 ranks cuts 4 stages, a unit each
MOE_MODELS["mixtral4_grouped"] = (
    lambda: MoECausalLM("mixtral", "grouped_mm", layers=4),
    _token_batch,
    {"classes": ["MixtralDecoderLayer"]},
)


class OneSidedExperts(nn.Module):
    """4 experts stacked along dim 0, called as transformers' experts modules are
    (``hidden_states, top_k_index, top_k_weights``), each hit expert's tokens found with
    ``nonzero`` (data-dependent: captured as a region); with no token, the output is zeros
    that depend on nothing."""

    def __init__(self, hidden: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.num_experts = experts
        self.up = nn.Parameter(torch.randn(experts, 2 * hidden, hidden) / hidden**0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, 2 * hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in index.unique().tolist():  # the experts hit only, as transformers' loop
            token, slot = torch.nonzero(index == e, as_tuple=True)
            h = torch.relu(x[token] @ self.up[e].T) @ self.down[e].T
            out.index_add_(0, token, h * weights[token, slot, None])
        return out


class OneSidedMoE(nn.Module):
    """A mixture of experts whose router sends every token to expert 0 or 1 (by a learned
    gate's sign), never 2 or 3: under ``ep 2`` the second rank's experts receive no token at
    any step, and it must still take part in every exchange, forward and backward."""

    def __init__(self, vocab: int = 64, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.gate = nn.Linear(hidden, 1)
        self.experts = OneSidedExperts(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).flatten(0, 1)
        score = self.gate(x)
        index = (score > 0).long()  # expert 0 or 1
        y = x + self.experts(x, index, torch.sigmoid(score))
        logits = self.head(y)
        return nn.functional.cross_entropy(logits[:-1], ids.flatten()[1:])


def _experts_only() -> OneSidedMoE:
    """OneSidedMoE fine-tuning its experts and head alone: the experts' input needs no
    gradient, their weights do."""
    model = OneSidedMoE()
    for module in (model.embed, model.gate):
        module.requires_grad_(False)
    return model


EP_MODELS = {
    "one_sided_moe": (OneSidedMoE, _token_batch, {"classes": ["OneSidedExperts"]}),
    "one_sided_experts_only": (_experts_only, _token_batch, {"classes": ["OneSidedExperts"]}),
}


# Models deep enough to cut into 4 pipeline stages (tests/parity/test_pipeline_parity.py).
def tiny_gpt_4_layers_dropout() -> GPT:
    """The 4-block tiny GPT with dropout (embeddings, attention, both residuals): a pipeline's
    draws under ``capture.draws: keyed`` against one process drawing by the same keys."""
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16, dropout=0.1))


PIPELINE_MODELS = {
    "gpt4": (tiny_gpt_4_layers, _gpt_batch, {"classes": ["Block"]}),
    "gpt4_dropout": (tiny_gpt_4_layers_dropout, _gpt_batch, {"classes": ["Block"]}),
}


def entry(name: str) -> tuple[Callable[[], nn.Module], Callable[..., Any], dict[str, Any]]:
    """The (build, batch, units) of a model of any registry here, by name."""
    registries = (MODELS, MODEL_KINDS, RANDOM_MODELS, RANDOM_KINDS, TP_MODELS, PIPELINE_MODELS,
                  MOE_MODELS, EP_MODELS)  # fmt: skip
    for registry in registries:
        if name in registry:
            return registry[name]
    raise KeyError(name)

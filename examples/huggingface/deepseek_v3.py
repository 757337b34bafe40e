"""A DeepSeek-V3-sized mixture of experts (671B parameters: 61 layers, 256 routed experts of
which each token takes 8, one shared expert, multi-head latent attention) from transformers,
built on the meta device with random tokens: a workload for `zerocc estimate` and `zerocc
inspect`, which never allocate it. `layers` shrinks it (the first 3 are dense)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from zerocc import Workload

VOCAB = 129280


def workload(seq_len: int = 4096, batch_size: int = 1, layers: int = 61) -> Workload:
    """DeepSeek-V3's sizes (its config.json), ``layers`` decoder layers, on ``meta``."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=layers, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
        n_shared_experts=1, first_k_dense_replace=3, max_position_embeddings=seq_len,
    )  # fmt: skip
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)

    def batches(rank: int, world_size: int) -> Iterator[tuple[torch.Tensor]]:
        g = torch.Generator().manual_seed(rank)
        while True:
            yield (torch.randint(0, VOCAB, (batch_size, seq_len), generator=g),)

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, labels=ids, use_cache=False).loss  # (training reads no cache)

    return Workload(model, loss_fn=loss_fn, batches=batches)

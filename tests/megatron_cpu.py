"""Megatron-Core 0.16.1 on CPU over gloo, for the tests and the benchmark (test-only patches, no
fork: ../shared/notes/megatron.md), a `GPTModel` built from a transformers config, and the test's
own loader of a checkpoint into a rank's shards (the inverse of weightsync's `MegatronSource`,
written from Megatron's layout, so that a push landing the checkpoint checks both).

    patch_for_cpu()                 a CPU RNG tracker, `current_device` and `.cuda()` on cpu, ...
    build(hf_config, tp, pp, ep)    parallel state and this rank's GPTModel (local spec, fp32)
    load_checkpoint(model, state)   this rank's shards cut from the checkpoint's whole tensors
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def patch_for_cpu() -> None:
    """What Megatron-Core hard-codes to CUDA, redirected to the CPU (test processes only)."""
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.moe import moe_utils

    class CpuTracker(random.CudaRNGStatesTracker):
        def add(self, name: str, seed: int) -> None:
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()
            self.seeds_.add(seed)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    tracker = CpuTracker()
    for name, seed in [("model-parallel-rng", 1), ("data-parallel-rng", 2), ("expert-parallel-rng", 3)]:
        tracker.add(name, seed)
    random._CUDA_RNG_STATE_TRACKER = tracker
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]  # tied, PP > 1
    moe_utils.te_general_gemm = None  # 0.16.1 without Transformer Engine: a NameError otherwise


def build(hf: Any, tp: int, pp: int, ep: int) -> Any:
    """Megatron's parallel state over the default (gloo) group and this rank's `GPTModel` of the
    transformers config `hf` (Llama, Qwen2, Qwen3-MoE), fp32, local spec."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    patch_for_cpu()
    experts = getattr(hf, "num_experts", None)
    qk_norm = hf.model_type.startswith("qwen3")
    config = TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf.model_type == "qwen2",
        qk_layernorm=qk_norm,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        num_moe_experts=experts,
        moe_ffn_hidden_size=getattr(hf, "moe_intermediate_size", None),
        moe_router_topk=getattr(hf, "num_experts_per_tok", 2),
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        batch_p2p_comm=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=qk_norm)
    return GPTModel(
        config,
        spec,
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=hf.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(hf.rope_parameters["rope_theta"]),
    )


@torch.no_grad()
def load_checkpoint(model: Any, state: dict[str, torch.Tensor]) -> None:
    """This rank's shard of every parameter of `model` cut from the checkpoint `state`, by
    Megatron's layout: q, k, v interleaved per query group, gate and up halves per rank, rows of
    the vocabulary and of column-parallel layers, columns of row-parallel ones, global expert and
    layer numbers."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    config = model.config
    for name, param in model.named_parameters():
        if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
            name = "embedding.word_embeddings.weight"
        parts = name.split(".")
        if parts[0] == "embedding":
            param.copy_(_rows(state["model.embed_tokens.weight"], param.shape[0], rank))
            continue
        if parts[0] == "output_layer":
            param.copy_(_rows(state["lm_head.weight"], param.shape[0], rank))
            continue
        if name == "decoder.final_layernorm.weight":
            param.copy_(state["model.norm.weight"])
            continue
        layer = model.decoder.layers[int(parts[2])]
        prefix = f"model.layers.{layer.layer_number - 1}."
        rest = ".".join(parts[3:])
        if rest.startswith("mlp.experts.local_experts."):
            number = ps.get_expert_model_parallel_rank() * layer.mlp.experts.num_local_experts + int(parts[6])
            expert = f"{prefix}mlp.experts.{number}."
            if parts[-2] == "linear_fc1":
                param.copy_(torch.cat([state[expert + "gate_proj.weight"], state[expert + "up_proj.weight"]]))
            else:
                param.copy_(state[expert + "down_proj.weight"])
            continue
        param.copy_(_layer_shard(rest, prefix, state, config, tp, rank))


def _layer_shard(rest: str, prefix: str, state: dict[str, torch.Tensor], config: Any, tp: int, rank: int) -> Any:
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "mlp.router.weight": "mlp.gate.weight",
    }
    if rest in simple:
        return state[prefix + simple[rest]]
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        groups, head = config.num_query_groups, config.kv_channels
        q, k, v = (state[f"{prefix}self_attn.{p}_proj.{kind}"] for p in "qkv")
        tail = q.shape[1:]
        fused = torch.cat(
            [q.reshape(groups, -1, head, *tail), k.reshape(groups, 1, head, *tail), v.reshape(groups, 1, head, *tail)],
            dim=1,
        )
        return fused.chunk(tp)[rank].reshape(-1, *tail)
    if rest == "self_attention.linear_proj.weight":
        return state[prefix + "self_attn.o_proj.weight"].chunk(tp, dim=1)[rank]
    if rest == "mlp.linear_fc1.weight":
        gate, up = state[prefix + "mlp.gate_proj.weight"], state[prefix + "mlp.up_proj.weight"]
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    if rest == "mlp.linear_fc2.weight":
        return state[prefix + "mlp.down_proj.weight"].chunk(tp, dim=1)[rank]
    raise KeyError(rest)


def _rows(whole: torch.Tensor, local_rows: int, rank: int) -> torch.Tensor:
    """Rows [rank * local_rows, ...) of `whole`, padded with zeros past its end."""
    padded = torch.zeros(local_rows * (rank + 1), *whole.shape[1:], dtype=whole.dtype)
    kept = min(whole.shape[0], padded.shape[0])
    padded[:kept] = whole[:kept]
    return padded[rank * local_rows :]


def whole_tensors(model: Any, name: str, shards: list[torch.Tensor], config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of parameter `name` of a one-stage `model`, from its shards of every
    tensor-parallel rank (one shard: not split), as a bridge converts them."""
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        hf = "model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"
        yield hf, torch.cat(shards)[: model.vocab_size]
        return
    if name == "decoder.final_layernorm.weight":
        yield "model.norm.weight", shards[0]
        return
    parts = name.split(".")
    prefix, rest = f"model.layers.{int(parts[2])}.", ".".join(parts[3:])
    if rest.startswith("self_attention.linear_qkv."):
        groups, head = config.num_query_groups, config.kv_channels
        fused = torch.cat(shards).reshape(groups, -1, head, *shards[0].shape[1:])
        q, k, v = fused[:, :-2], fused[:, -2], fused[:, -1]
        kind = parts[-1]
        for letter, tensor in zip("qkv", (q, k, v), strict=True):
            yield f"{prefix}self_attn.{letter}_proj.{kind}", tensor.reshape(-1, *shards[0].shape[1:])
    elif rest == "mlp.linear_fc1.weight":
        yield prefix + "mlp.gate_proj.weight", torch.cat([shard.chunk(2)[0] for shard in shards])
        yield prefix + "mlp.up_proj.weight", torch.cat([shard.chunk(2)[1] for shard in shards])
    elif rest in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        hf = "self_attn.o_proj.weight" if rest.startswith("self") else "mlp.down_proj.weight"
        yield prefix + hf, torch.cat(shards, dim=1)
    else:
        simple = {
            "input_layernorm.weight": "input_layernorm.weight",
            "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
            "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        }
        yield prefix + simple[rest], shards[0]

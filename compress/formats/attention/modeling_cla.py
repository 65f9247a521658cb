"""Cross-layer attention (CLA, Brandon et al. 2024, arXiv 2405.12981) on transformers' Llama.

Layer i of a group of ``cla_share`` layers attends with the K/V of the group's first layer
f = i - i % s: only layer f has ``k_proj``/``v_proj`` and only layer f writes the cache::

    K_f, V_f = RoPE(x_f W_k,f), x_f W_v,f                x_f = input_layernorm_f(h_f)
    out_i    = o_proj_i(attention(RoPE(x_i W_q,i), K_f, V_f))    for every i of the group

Self-contained (transformers only): a run folder carries this file for ``trust_remote_code``.
"""

from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    LlamaAttention,
    LlamaForCausalLM,
    apply_rotary_pos_emb,
    eager_attention_forward,
    rotate_half,
)

from .configuration_cla import CLAConfig


class CLAAttention(LlamaAttention):
    def __init__(self, config: CLAConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.kv_layer = config.kv_layer(layer_idx)
        if self.kv_layer != layer_idx:
            del self.k_proj, self.v_proj
        self.shared = {}  # {first layer: (K, V)} of the running forward; the model shares one dict

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs
    ):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        if self.kv_layer == self.layer_idx:
            k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
            v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            if cache is not None:
                k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
            self.shared[self.layer_idx] = (k, v)
        else:
            q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
            k, v = self.shared[self.kv_layer]
        if (self.layer_idx + 1) % self.config.cla_share == 0:  # the group's last layer: let K/V go
            del self.shared[self.kv_layer]
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attention(
            self,
            q,
            k,
            v,
            attention_mask,
            scaling=self.scaling,
            dropout=self.attention_dropout if self.training else 0.0,
            **kwargs,
        )
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


class CLAForCausalLM(LlamaForCausalLM):
    config_class = CLAConfig

    def __init__(self, config: CLAConfig):
        super().__init__(config)
        shared = {}
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = CLAAttention(config, i).to(layer.self_attn.q_proj.weight.device)
            layer.self_attn.shared = shared
        self.post_init()


__all__ = ["CLAForCausalLM"]

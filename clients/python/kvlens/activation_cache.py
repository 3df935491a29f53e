"""TransformerLens's activation names and cache, for Client.run_with_cache: the full hook
names kvlens answers to (blocks.{layer}.attn.hook_pattern, …), get_act_name as in
TransformerLens's utils, and ActivationCache with its stacks (accumulated_resid,
decompose_resid, stack_head_results, apply_ln_to_stack). No gRPC here."""
from __future__ import annotations

import re
from typing import Optional

import numpy as np


# TransformerLens's full hook names, after "blocks.{layer}.", and the short ones.
_FULL_HOOK_NAMES = {
    "hook_resid_pre": "resid_pre", "hook_resid_mid": "resid_mid",
    "hook_resid_post": "resid_post", "hook_attn_out": "attn_out", "hook_mlp_out": "mlp_out",
    "attn.hook_z": "z", "attn.hook_result": "result", "attn.hook_q": "q", "attn.hook_k": "k",
    "attn.hook_v": "v", "attn.hook_rot_q": "rot_q", "attn.hook_rot_k": "rot_k",
    "attn.hook_attn_scores": "attn_scores", "attn.hook_pattern": "pattern",
    "mlp.hook_pre": "mlp_pre", "mlp.hook_pre_linear": "mlp_pre_linear",
    "mlp.hook_post": "mlp_post",
    "ln1.hook_scale": "ln1_scale", "ln1.hook_normalized": "ln1_normalized",
    "ln2.hook_scale": "ln2_scale", "ln2.hook_normalized": "ln2_normalized",
    "ln1_post.hook_scale": "ln1_post_scale", "ln1_post.hook_normalized": "ln1_post_normalized",
    "ln2_post.hook_scale": "ln2_post_scale", "ln2_post.hook_normalized": "ln2_post_normalized",
}
# The families that norm each block's output (TransformerLens's ln1_post, ln2_post).
_BLOCK_OUTPUT_NORM_FAMILIES = ("gemma2", "gemma3", "gemma3_text")
# ... and those without a layer, before the blocks and after them.
_FULL_EMBED_NAMES = {"hook_embed": "embed", "hook_pos_embed": "pos_embed"}
_FULL_FINAL_NAMES = {"ln_final.hook_scale": "ln_final_scale",
                     "ln_final.hook_normalized": "ln_final_normalized"}
_FULL_NAME = re.compile(r"blocks\.(\d+)\.(.+)")

_ACT_ALIASES = {"a": "pattern", "attn": "pattern", "attn_logits": "attn_scores", "key": "k",
                "query": "q", "value": "v", "mlp_pre": "pre", "mlp_mid": "mid",
                "mlp_post": "post"}
_ATTN_HOOKS = ("k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores")
_MLP_HOOKS = ("pre", "post", "mid", "pre_linear")


def get_act_name(name: str, layer: Optional[int] = None,
                 layer_type: Optional[str] = None) -> str:
    """TransformerLens's utils.get_act_name: the full hook name of a short one, as its
    ActivationCache reads cache[name, layer, layer_type]: ("pattern", 1) →
    "blocks.1.attn.hook_pattern", ("scale", 2, "ln1") → "blocks.2.ln1.hook_scale",
    ("normalized", None, "ln_final") → "ln_final.hook_normalized"; a name with a dot or
    starting hook_ is full already."""
    if "." in name or name.startswith("hook_"):
        return name
    name = _ACT_ALIASES.get(name, name)
    layer_type = {"a": "attn", "m": "mlp", "b": "", "block": "", "blocks": ""}.get(
        layer_type, layer_type)
    if name in _ATTN_HOOKS:
        layer_type = "attn"
    elif name in _MLP_HOOKS:
        layer_type = "mlp"
    prefix = "" if layer is None else f"blocks.{layer}."
    return f"{prefix}{layer_type + '.' if layer_type else ''}hook_{name}"


class ActivationCache(dict):
    """run_with_cache's arrays, {"hook.layer": array} ("ln_final" has no layer), also read
    as TransformerLens's ActivationCache is: cache["pattern", 1], with the layer counted
    from the end, cache["resid_post", -1] (num_layers: the model's), and under the full
    names, cache["blocks.1.attn.hook_pattern"], cache["ln_final.hook_normalized"], and
    through TL's aliases (get_act_name): cache["attn", 1], cache["scale", 2, "ln1"] (and so
    do `in` and get()).
    Arrays have no batch dimension: [positions, …]. Its stacks (accumulated_resid,
    decompose_resid, stack_head_results, apply_ln_to_stack) are TransformerLens's, read
    from the hooks they need (a missing one is a KeyError naming it); as there, their
    layer=None or -1 means every layer (and the final stream)."""

    def __init__(self, arrays: dict, num_layers: int, layer_norm: bool = False):
        super().__init__(arrays)
        self.num_layers = num_layers
        self.layer_norm = layer_norm  # LayerNorm (centres) rather than RMSNorm

    def _upto(self, layer):
        return self.num_layers if layer is None or layer == -1 else layer

    def _stacked(self, parts, labels, layer, mlp_input, apply_ln, return_labels):
        stack = np.stack(parts)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input)
        return (stack, labels) if return_labels else stack

    def accumulated_resid(self, layer=None, incl_mid=False, apply_ln=False, mlp_input=False,
                          return_labels=False):
        """The stream entering each layer before `layer` (and `layer`'s, with its resid_mid
        when mlp_input), plus resid_mid between them when incl_mid; at layer = num_layers
        (default) the stream leaving the last: [components, positions, d_model], labels
        "0_pre", "0_mid", …, "final_post"."""
        layer = self._upto(layer)
        parts, labels = [], []
        for l in range(layer + 1):
            if l == self.num_layers:
                parts.append(self["resid_post", l - 1])
                labels.append("final_post")
                continue
            parts.append(self["resid_pre", l])
            labels.append(f"{l}_pre")
            if (incl_mid and l < layer) or (mlp_input and l == layer):
                parts.append(self["resid_mid", l])
                labels.append(f"{l}_mid")
        return self._stacked(parts, labels, layer, mlp_input, apply_ln, return_labels)

    def decompose_resid(self, layer=None, mlp_input=False, mode="all", apply_ln=False,
                        incl_embeds=True, return_labels=False):
        """What each part wrote into the stream entering `layer` (default: leaving the last):
        embed (and pos_embed, when cached), then each earlier layer's attn_out and mlp_out
        (mode "attn" or "mlp": only those), and `layer`'s attn_out when mlp_input; they sum
        to that stream. [components, positions, d_model], labels "embed", "0_attn_out", …"""
        layer = self._upto(layer)
        parts, labels = [], []
        if incl_embeds:
            for name in ("embed", "pos_embed"):
                if name in self:
                    parts.append(self[name])
                    labels.append(name)
        for l in range(layer):
            for kind in ("attn", "mlp"):
                if mode in ("all", kind):
                    parts.append(self[f"{kind}_out", l])
                    labels.append(f"{l}_{kind}_out")
        if mlp_input and mode != "mlp":
            parts.append(self["attn_out", layer])
            labels.append(f"{layer}_attn_out")
        return self._stacked(parts, labels, layer, mlp_input, apply_ln, return_labels)

    def stack_head_results(self, layer=None, apply_ln=False, return_labels=False):
        """Each head's result of every layer before `layer` (default: all):
        [layers · heads, positions, d_model], labels "L0H0", "L0H1", …"""
        layer = self._upto(layer)
        parts, labels = [], []
        for l in range(layer):
            r = self["result", l]  # [positions, heads, d_model]
            parts.extend(r.transpose(1, 0, 2))
            labels.extend(f"L{l}H{h}" for h in range(r.shape[1]))
        return self._stacked(parts, labels, layer, False, apply_ln, return_labels)

    def apply_ln_to_stack(self, stack, layer=None, mlp_input=False):
        """Components [..., positions, d_model] through the norm that reads the stream at
        `layer` (default: the final norm; mlp_input: the layer's FFN norm, ln2), with that
        run's scale frozen: centred (LayerNorm), over ln*_scale, no weight — so the
        components of a decomposition add up to the norm's normalized input."""
        layer = self._upto(layer)
        if self.layer_norm:
            stack = stack - stack.mean(-1, keepdims=True)
        if layer == self.num_layers:
            return stack / self["ln_final_scale"]
        return stack / self[f"ln{2 if mlp_input else 1}_scale", layer]

    def _key(self, key):
        if isinstance(key, tuple):  # (name, layer[, layer_type]), as TransformerLens's
            name, layer, *rest = key
            if layer is not None and layer < 0:
                layer += self.num_layers
            full = self._key(get_act_name(name, layer, *rest))
            if super().__contains__(full):
                return full
            return name if layer is None else f"{name}.{layer}"  # kvlens's ("ln1_scale", 2)
        if key in _FULL_FINAL_NAMES:
            return _FULL_FINAL_NAMES[key]
        if key in _FULL_EMBED_NAMES:
            return _FULL_EMBED_NAMES[key]
        full = _FULL_NAME.fullmatch(key) if isinstance(key, str) else None
        if full and full.group(2) in _FULL_HOOK_NAMES:
            return f"{_FULL_HOOK_NAMES[full.group(2)]}.{full.group(1)}"
        return key

    def __getitem__(self, key):
        return super().__getitem__(self._key(key))

    def __contains__(self, key):
        return super().__contains__(self._key(key))

    def get(self, key, default=None):
        key = self._key(key)
        return super().get(key, default)

"""The self-speculative draft of LayerSkip (Elhoushi et al. 2024): the target's first n layers,
then its final norm and shared LM head. A view over the target's modules: no weight is copied,
so the draft costs no weight memory, only its own KV cache for n layers."""

from __future__ import annotations

from torch import nn

from engine.model.decoder import CausalLM, DecoderModel


class EarlyExitDraft(nn.Module):
    def __init__(self, target: CausalLM, num_layers: int) -> None:
        super().__init__()
        inner = target.model
        # References to the target's own modules (shared parameters, not copies).
        self.embed_tokens, self.rotary, self.norm = inner.embed_tokens, inner.rotary, inner.norm
        self.layers = nn.ModuleList(inner.layers[:num_layers])
        self.lm_head = target.lm_head
        self.config = target.config.first_layers(num_layers)

    # The target's own decoder loop (embed, layers, final norm), which runs over self.layers:
    # one definition of the forward pass, so the draft can never drift from the target.
    forward = DecoderModel.forward
    compute_logits = CausalLM.compute_logits


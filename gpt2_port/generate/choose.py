"""Choosing each row's next token on the device, without waiting for it: the fast greedy head where it proves its
argmax, else the head's logits, processed in float32 (sampling.py), then argmax (of the logits in the model's dtype
where nothing processes them) or a draw from the softmax. Whether the logits (and a sampled distribution) were finite
travels beside the ids: the loop learns both in one transfer a token."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..devices import all_finite
from ..io.load import listed, nonfinite_tensors
from .greedy_head import FastGreedyHead
from .greedy_pick import argmax_finite
from .protocol import CausalLM
from .sampling import SamplingSettings, draw, process_logits

# What NextToken's second result reads as on the host (a bool counts as 1 or 0)
OK, NONFINITE, DRAWN_FROM_NAN = 1, 0, 2


class NextToken:
    """(B, 1, C) final hidden states of the last position -> ((B,) next ids, () status), on the device.

    Logits that hold NaN or Inf must stop generation (the loop raises, naming the step: `nonfinite_message`): their
    argmax would be an arbitrary token and text made of it silent garbage. So must sampling scores that overflowed
    (status DRAWN_FROM_NAN, else OK, or NONFINITE for the logits; transformers' multinomial raises there).

    record: a list to append each step's (B, V) float32 scores to, the processed logits the token was chosen from (the
    fast head is then off: it makes no logits).
    """

    def __init__(
        self,
        model: CausalLM,
        settings: SamplingSettings,
        seen: torch.Tensor | None,
        generator: torch.Generator | None,
        fast_head: bool,
        record: list[torch.Tensor] | None = None,
        hold_eos: tuple[int, int] | None = None,
    ) -> None:
        self.model, self.settings, self.seen, self.generator = model, settings, seen, generator
        self.record = record
        self.hold_eos = hold_eos  # (eos id, steps): EOS cannot be chosen before that many new tokens
        greedy = not settings.do_sample and settings.repetition_penalty == 1.0
        usable = fast_head and greedy and record is None and FastGreedyHead.usable(model)
        self.fast_head = FastGreedyHead.for_model(model) if usable else None
        # a plain argmax takes the head's logits in the model's dtype: their float32 copy (exact, so the same order
        # and the same ties) is only needed where scores are processed or kept (a (B, V) cast kernel a token less)
        self.plain_argmax = greedy and record is None
        self.exact_steps = 0  # steps where the fast head could not prove its argmax

    def __call__(self, h: torch.Tensor, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        held = self.hold_eos is not None and step < self.hold_eos[1]
        if self.fast_head is not None and not held:  # on the CPU only: its checks read host values, no device wait
            nxt = self.fast_head.argmax(h[:, -1])
            if nxt is not None:
                return nxt, torch.ones((), dtype=torch.bool)
            self.exact_steps += 1
        logits = self.model.head(h)[:, -1]  # (B, V)
        if self.plain_argmax and not held:
            return argmax_finite(logits)  # on CUDA one kernel (greedy_pick.py)
        if not self.plain_argmax:
            logits = logits.float()
        finite = all_finite(logits)
        if held:  # transformers' MinNewTokensLengthLogitsProcessor: EOS's score -inf (a column fill: no host copy)
            logits[:, self.hold_eos[0]] = -float("inf")
        if self.plain_argmax:
            return torch.argmax(logits, dim=-1), finite
        if self.settings.do_sample:
            # non-finite logits: draw from harmless scores instead (NaN probabilities would make an arbitrary token);
            # the loop raises on `finite` before any of those tokens is used. Greedy needs no such fill (two kernels a
            # token): the argmax of non-finite scores is some token, never used either.
            logits = logits.masked_fill(~finite, 0.0)
        scores = process_logits(logits, self.seen, self.settings)
        if self.record is not None:
            self.record.append(scores.clone())  # (B, V), on the device: no wait
        if self.settings.do_sample:
            probs = F.softmax(scores, dim=-1)
            # finite logits divided by a tiny temperature or repetition penalty can overflow to +-Inf, whose softmax
            # is NaN: that is flagged too (DRAWN_FROM_NAN), in the same transfer as the logits' own check
            status = torch.where(finite, torch.where(all_finite(probs), OK, DRAWN_FROM_NAN), NONFINITE)
            return draw(probs, self.generator), status  # (B,)
        return torch.argmax(scores, dim=-1), finite


def overflow_message(settings: SamplingSettings, step: int) -> str:
    """One line: the step whose finite logits the sampling settings turned into Inf (a NaN distribution)."""
    named = [
        f"{k} {getattr(settings, k):g}" for k in ("temperature", "repetition_penalty") if getattr(settings, k) != 1
    ]
    return (
        f"generate: step {step + 1} (new token {step + 1}): {' and '.join(named)} turn finite logits into Inf, so "
        "there is no distribution to sample from; expected a larger temperature (or greedy decoding) or a penalty "
        "nearer 1"
    )


def nonfinite_message(model: CausalLM, step: int) -> str:
    """One line: the step whose logits are not finite, and the weights that are not (checked now, once)."""
    bad = nonfinite_tensors(dict(model.named_parameters()) | dict(model.named_buffers()))
    if bad:
        cause = f"non-finite weights: {listed(bad)} (expected finite values; check the checkpoint)"
    else:
        cause = f"the weights are all finite, so an activation overflowed in {str(model.dtype).removeprefix('torch.')}"
    return f"generate: the logits of step {step + 1} (new token {step + 1}) hold NaN or Inf; {cause}"

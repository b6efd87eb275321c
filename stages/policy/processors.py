"""The HF backend's logits processors that ride along with transformers' `generate` (stages/policy/hf.py): the
log-prob recorder (log_softmax(logits / T) at each sampled token, the definition in stages/policy/sampling.py, and the
top k for rows that ask) and the inverse-CDF sampler that draws each row's token itself and hands the recorder its
log-normalisers. The VLM's `generate` (stages/policy/vlm.py) uses the same two.

torch is imported inside the methods that need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class _LogprobRecorder:
    """A logits processor that records log_softmax(logits / T) at each sampled token, and for the rows
    that ask (`top_k[row] > 0`) the k most likely tokens of that same distribution.

    transformers runs custom processors after its own (none are configured here) and before the
    sampling warpers (temperature, top_p), so `scores` are the raw logits, or the constraint-masked
    ones when a `GrammarMasker` runs first. The token sampled from step t's scores shows up as the last
    column of `input_ids` at step t+1, so only one step of logits is kept alive: O(B * V) memory instead
    of the O(B * T * V) of `output_logits=True`.
    """

    def __init__(self, temperature: float, top_k: list[int] | None = None) -> None:
        self.temperature = temperature
        self._scores: torch.Tensor | None = None  # (B, V) raw logits of the previous step
        self._logprobs: list[torch.Tensor] = []  # per step, (B,)
        # Only the rows that ask pay for a top-k: no (B, V) work when none does.
        self._top_rows = [r for r, k in enumerate(top_k or []) if k > 0]
        self._k = max(top_k or [0])
        self._top: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step, (R, k) log-probs and ids
        self._norm: torch.Tensor | None = None  # (B,) float64 log-normaliser the sampler found this step (`normaliser`)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._scores is not None:
            self._collect(input_ids[:, -1])
        # The warpers after this one return new tensors (no in-place edits), so a reference suffices.
        self._scores = scores
        return scores

    def normaliser(self, norm: torch.Tensor) -> None:
        """logsumexp(z / T) per row (B,), float64, as this step's sampler computed it on its way to the draw: the
        recorder then reads only the picked (and top) tokens' scores, no pass of its own over (B, V). Every row's
        log-prob is the same float64 difference whatever the other rows ask, so a free row records the same bits
        in a batch with top-logprob rows as without."""
        self._norm = norm

    def _collect(self, tokens: torch.Tensor) -> None:
        import torch

        norm, self._norm = self._norm, None
        if norm is not None:  # the sampler's: z in float64, as it drew from it
            z = self._scores.gather(1, tokens[:, None]).squeeze(1).double()  # (B,)
            self._logprobs.append(((z / self.temperature if self.temperature != 1.0 else z) - norm).float())
            if self._top_rows:
                rows = torch.tensor(self._top_rows, device=norm.device)
                values, ids = self._scores[rows].topk(self._k, dim=-1)  # (R, k), best first
                values = values.double() / self.temperature if self.temperature != 1.0 else values.double()
                self._top.append(((values - norm[rows, None]).float().cpu(), ids.cpu()))
            return
        z = self._scores.float()  # (B, V)
        if self.temperature != 1.0:
            z = z / self.temperature
        # log_softmax at one token = z[token] - logsumexp(z): no (B, V) log-prob tensor is written.
        norm = torch.logsumexp(z, dim=-1)  # (B,)
        picked = z.gather(1, tokens[:, None]).squeeze(1)  # (B,)
        self._logprobs.append(picked - norm)
        if self._top_rows:
            rows = torch.tensor(self._top_rows, device=z.device)
            values, ids = z[rows].topk(self._k, dim=-1)  # (R, k), best first
            self._top.append(((values - norm[rows, None]).cpu(), ids.cpu()))

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """Log-probs of all generated tokens, (B, n); `last_tokens` (B,) were sampled at the last step."""
        import torch

        self._collect(last_tokens)
        self._scores = None
        return torch.stack(self._logprobs, dim=1)

    def top(self, row: int, k: int, n: int) -> list[list[tuple[int, float]]] | None:
        """Row `row`'s k most likely (token id, log-prob) at each of its first n steps; None if it did not ask."""
        if row not in self._top_rows:
            return None
        r = self._top_rows.index(row)
        # A constraint can leave fewer than k tokens possible: the impossible ones (-inf) are left out.
        return [[(t, v) for t, v in zip(ids[r, :k].tolist(), lps[r, :k].tolist()) if v != float("-inf")]
                for lps, ids in self._top[:n]]


class _InverseCDFSampler:
    """Draws each row's next token itself and hands `generate` a score row where only that token is finite,
    so generate's greedy step takes it. The draw is exact inverse-CDF sampling: one uniform per row against
    the cumulative softmax (float64). `torch.multinomial` over SmolLM2's 49k vocabulary costs ~30 ms per
    decoding step for 32 rows on 2 CPU cores (a sixth of generation), most of it drawing random numbers
    for the whole vocabulary; this draws one per row. Seeded by the global RNG, as generate's sampling is.
    Used when top_p == 1 (no truncation to implement).

    The cumulative sum is of exp(z - max) unnormalised, in place, and the uniform is scaled by its total: the same
    draw as against the normalised softmax's, in 4 passes over (B, V) instead of ~8. Given the `recorder`, it hands
    it each row's log-normaliser (max + log total), so the recorder needs no pass of its own: 10-12 -> ~2 ms per
    decoding step for (32, 49152) (docs/BENCHMARKS.md)."""

    def __init__(self, temperature: float, recorder: _LogprobRecorder | None = None) -> None:
        self.temperature = temperature
        self.recorder = recorder
        # (B, V) float64 work space and the (B, V) row handed to generate, kept across the steps of a call: a fresh
        # 12 MB tensor per step cost page faults that measured as much as the passes themselves.
        self._cdf: torch.Tensor | None = None
        self._out: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        if self._cdf is None or self._cdf.shape != scores.shape or self._cdf.device != scores.device:
            self._cdf = torch.empty(scores.shape, dtype=torch.float64, device=scores.device)
            self._out = torch.empty_like(scores)
        cdf = self._cdf.copy_(scores)  # (B, V) z in float64
        if self.temperature != 1.0:  # z / 1.0 is z: no pass over (B, V) for it
            cdf.div_(self.temperature)
        top = cdf.amax(-1, keepdim=True)  # (B, 1)
        cdf.sub_(top).exp_().cumsum_(-1)  # cumulative unnormalised softmax
        total = cdf[:, -1:]  # (B, 1)
        u = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device) * total  # (B, 1)
        pick = torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1)  # (B, 1): first cdf > u
        if self.recorder is not None:
            self.recorder.normaliser((top + total.log()).squeeze(1))
        # generate takes its argmax at once and keeps nothing of it, so one buffer serves every step
        return self._out.fill_(float("-inf")).scatter_(1, pick, 0.0)

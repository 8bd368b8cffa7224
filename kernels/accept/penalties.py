"""Step 0 of the processed law (repetition, frequency and presence penalties, logit bias, min-tokens), fused into
every read of a walked row: `_penalized` turns a row's entries, as `_load_row` reads them, into the values after
step 0, at one node of one request (a `Penalties`, built once per program by `_request_penalties`).

The node's counts are the request's output counts (one int32 per entry read, V x 4 bytes per pass over a row)
plus its path tokens (its ancestors' draft tokens, node 0's excluded: at most T of them, chased through the
parents and added as point corrections); the prompt mask is read as bits (V / 8 bytes per pass), the bias
entries and stop ids one by one (K and S scalars per tile). No row is copied, and the launch depends on shapes
only. `penalty_args` is the host side: the launcher's (and the logprobs kernel's) normalized arguments.

Arithmetic (the reference's `penalized_row`): in vLLM's order (logit bias, min-tokens' stop tokens, then the
repetition, frequency and presence penalties: a repetition penalty scales the biased logit), each step one
rounded float32 operation for logits; float64 for probabilities (their logs in float64, as the reference takes
them), rounded to float32 once at the end. float64 rows never get here: the launcher applies step 0 on the host
(`penalized_rows`, the same steps in float64) before the shift into float32's range it copies them for."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.reference import saturated

from .records import F32_MAX, NEG_INF, Penalties


@triton.jit
def _request_penalties(b, rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, bias_ids_ptr, bias_values_ptr,
                       min_tokens_ptr, stop_ids_ptr, generated_ptr, counted, prompt_words, K, S, tokens_ptr,
                       parents_ptr, T, V, PROBS: tl.constexpr, HAS_PENALTIES: tl.constexpr):
    """The `Penalties` of request b. rep_ptr ... S: `penalty_args`'s tuple, in its order (rep / freq / pres (B,)
    float32, counts (B, counted) int32, prompt (B, prompt_words) int32, bias ids (B, K) int32 / values (B, K)
    float32, min_tokens (B,) int32, stop ids (B, S) int32, generated (B,) int64, then the four ints);
    tokens / parents: the (B, T) int32 tree (padded form, also for packed rows), V the vocabulary. Without
    HAS_PENALTIES nothing is read: neutral values (a field of a `Request`, whose constexpr switches the compiler
    does not take as static in every `if`, so the record exists either way)."""
    b64 = b.to(tl.int64)
    rep = tl.full((), 1.0, tl.float32)
    freq = tl.full((), 0.0, tl.float32)
    pres = tl.full((), 0.0, tl.float32)
    min_tokens = tl.full((), 0, tl.int32)
    generated = tl.full((), 0, tl.int64)
    if HAS_PENALTIES:
        rep = tl.load(rep_ptr + b)
        freq = tl.load(freq_ptr + b)
        pres = tl.load(pres_ptr + b)
        min_tokens = tl.load(min_tokens_ptr + b)
        generated = tl.load(generated_ptr + b)
    return Penalties(rep=rep, inv_rep=1.0 / rep, freq=freq, pres=pres, counts=counts_ptr + b64 * counted,
                     counted=counted, prompt=prompt_ptr + b64 * prompt_words, prompt_words=prompt_words,
                     bias_ids=bias_ids_ptr + b64 * K, bias_values=bias_values_ptr + b64 * K, K=K,
                     stop_ids=stop_ids_ptr + b64 * S, S=S, min_tokens=min_tokens, generated=generated,
                     tok_row=tokens_ptr + b64 * T, par_row=parents_ptr + b64 * T, T=T, V=V, probs=PROBS)


@triton.jit
def _penalized(pen, node, cols, x):
    """float32 values after step 0 of entries x (as `_load_row` reads them: any float dtype; with pen.probs the
    probabilities, 0 = impossible) of tokens `cols` (same shape as x: a scalar or a tile; lanes outside [0, V)
    must hold -inf / 0 and stay so) in the row of node `node` of the request. Counts: the output counts plus
    the tokens of node's path (parents chased, node 0's excluded, at most T steps); generated = the output's
    length + the path's. Steps in the reference's order, each its own rounded operation (float32 for logits, float64
    for probabilities' logs); -inf stays -inf."""
    inside = (cols >= 0) & (cols < pen.V)
    extra = tl.zeros_like(cols)  # the path's occurrences of each token
    depth = tl.full((), 0, tl.int32)
    cur = node
    while (cur > 0) & (cur < pen.T) & (depth < pen.T):
        extra += (cols == tl.load(pen.tok_row + cur)).to(cols.dtype)
        cur = tl.load(pen.par_row + cur)
        depth += 1
    count = tl.load(pen.counts + cols, mask=inside & (cols < pen.counted), other=0) + extra
    words = tl.load(pen.prompt + cols // 32, mask=inside & (cols // 32 < pen.prompt_words), other=0)
    seen = (((words >> (cols % 32)) & 1) != 0) | (count > 0)
    if pen.probs:
        y = _steps(pen, cols, depth, count, seen, tl.log(x.to(tl.float32).to(tl.float64)), tl.float64)
    else:
        y = _steps(pen, cols, depth, count, seen, x.to(tl.float32), tl.float32)
    return y


@triton.jit
def _steps(pen, cols, depth, count, seen, x, DTYPE: tl.constexpr):
    """Step 0 on values x (DTYPE: float32 logits, or float64 logs of probabilities, upcast through float32: exact,
    where the interpreter's 16-bit arithmetic is not), each step one rounded DTYPE operation, f * count clamped and
    the result saturated (reference.saturated); -> float32."""
    given = x
    for k in range(pen.K):  # (one entry at a time, in order: duplicates add up as the reference adds them)
        x = tl.where(cols == tl.load(pen.bias_ids + k), x + tl.load(pen.bias_values + k).to(DTYPE), x)
    rep = pen.rep.to(DTYPE)
    inv_rep = pen.inv_rep.to(DTYPE)
    if DTYPE == tl.float64:
        inv_rep = 1.0 / rep
    x = tl.where(seen, tl.where(x > 0, x * inv_rep, x * rep), x)
    penalty = pen.freq.to(DTYPE) * count.to(DTYPE)
    if DTYPE == tl.float32:  # (a float32 f times a count never overflows float64)
        penalty = _clamped(penalty, F32_MAX)
    x = x - penalty
    x = x - pen.pres.to(DTYPE) * (count > 0).to(DTYPE)
    # saturated (at float32's range: the float64 path's result is a float32 too), then the stop tokens (after the
    # penalties, which keep a -inf as it is: the same as the reference's order)
    x = tl.where(given > NEG_INF, _clamped(x, F32_MAX), x)
    return _stopped(pen, cols, depth, x).to(tl.float32)


@triton.jit
def _clamped(x, top):
    return tl.minimum(tl.maximum(x, -top), top)


@triton.jit
def _stopped(pen, cols, depth, x):
    """x with the stop tokens at -inf while the node (depth tokens past the output) has not reached min_tokens."""
    if pen.generated + depth < pen.min_tokens:
        for s in range(pen.S):
            x = tl.where(cols == tl.load(pen.stop_ids + s), NEG_INF, x)
    return x


def penalty_args(B: int, V: int, device: torch.device, repetition_penalty=None, frequency_penalty=None,
                 presence_penalty=None, output_token_counts=None, prompt_token_mask=None, logit_bias_ids=None,
                 logit_bias_values=None, min_tokens=None, stop_token_ids=None):
    """The arguments of `_request_penalties` after b (rep ... generated, then counted, prompt_words, K, S; tokens,
    parents, T and V are the caller's), from specdec.ops.accept's normalized step-0 arguments; None when every one
    is None (step 0 off: the launch compiles without it). Absent parameters are neutral (rep 1, freq / pres 0,
    K = S = 0, min_tokens 0); generated is the row sum of output_token_counts, a device op (no host sync)."""
    step0 = (repetition_penalty, frequency_penalty, presence_penalty, output_token_counts, prompt_token_mask,
             logit_bias_ids, logit_bias_values, min_tokens, stop_token_ids)
    if all(x is None for x in step0):
        return None

    def per_request(x, fill, dtype):
        return torch.full((B,), fill, dtype=dtype, device=device) if x is None else x.to(dtype).contiguous()

    empty = torch.zeros((B, 0), dtype=torch.int32, device=device)
    counts = empty if output_token_counts is None else output_token_counts.contiguous()
    prompt = empty if prompt_token_mask is None else prompt_token_mask.contiguous()
    bias_ids = empty if logit_bias_ids is None else logit_bias_ids.contiguous()
    bias_values = (torch.zeros((B, 0), device=device) if logit_bias_values is None
                   else logit_bias_values.float().contiguous())
    stop_ids = empty if stop_token_ids is None or min_tokens is None else stop_token_ids.contiguous()
    generated = counts.sum(-1, dtype=torch.int64)
    return (per_request(repetition_penalty, 1.0, torch.float32), per_request(frequency_penalty, 0.0, torch.float32),
            per_request(presence_penalty, 0.0, torch.float32), counts, prompt, bias_ids, bias_values,
            per_request(min_tokens, 0, torch.int32), stop_ids, generated, counts.shape[1], prompt.shape[1],
            bias_ids.shape[1], stop_ids.shape[1])


def penalized_rows(rows, pen, tokens, parents, row_offsets=None):
    """Step 0 applied on the host to whole rows (the launcher's float64 path, whose rows it copies anyway:
    `_in_float32_range`): rows (B, T, V), or packed (N, V) with row_offsets (B,) (node i of request b at row
    row_offsets[b] + i); pen: `penalty_args`'s tuple; tokens / parents (B, T). The arithmetic of `_penalized`
    in the rows' dtype (float64 rows: float64, as the reference; others: float32, each step rounded), the
    path chased the same way (at most T steps, node 0's token excluded). Device ops only (no host sync)."""
    rep, freq, pres, counts, prompt, bias_ids, bias_values, min_tokens, stop_ids, generated = pen[:10]
    B, T = tokens.shape
    V = rows.shape[-1]
    dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    x = rows.reshape(-1, V).to(dtype)
    if row_offsets is None:
        b = torch.arange(B, device=rows.device).repeat_interleave(T)
        i = torch.arange(T, device=rows.device).repeat(B)
    else:
        n = torch.arange(x.shape[0], device=rows.device)
        starts = row_offsets.long()
        b = (torch.searchsorted(starts, n, right=True) - 1).clamp(0, B - 1)
        i = (n - starts[b]).clamp(0, T - 1)
    tok, par = tokens.long(), parents.long()
    count = torch.zeros_like(x, dtype=torch.int64)
    depth = torch.zeros_like(i)
    cur = i
    for _ in range(T):  # one ancestor of every row at a time (the kernel's loop, vectorized over rows)
        on = (cur > 0) & (cur < T)
        at = cur.clamp(0, T - 1)
        t = tok[b, at]
        inside = on & (t >= 0) & (t < V)
        count.scatter_add_(1, t.clamp(0, V - 1)[:, None], inside.long()[:, None])
        depth += on.long()
        cur = torch.where(on, par[b, at], 0)
    if counts.shape[1] > 0:
        count += counts[b].long()
    cols = torch.arange(V, device=rows.device)
    seen = count > 0
    if prompt.shape[1] > 0:
        seen |= ((prompt[b][:, cols // 32] >> (cols % 32)) & 1) != 0
    given = x
    for k in range(bias_ids.shape[1]):  # in order: duplicates add up as the reference adds them
        x = torch.where(cols == bias_ids[b, k, None], x + bias_values[b, k, None].to(dtype), x)
    r = rep.to(dtype)[b, None]
    x = torch.where(seen, torch.where(x > 0, x * (1.0 / r), x * r), x)
    top = torch.finfo(dtype).max
    x = x - (freq.to(dtype)[b, None] * count.to(dtype)).clamp(-top, top)
    x = saturated(given, x - pres.to(dtype)[b, None] * (count > 0).to(dtype))
    stopped = (generated[b] + depth < min_tokens[b])[:, None]  # (after the penalties: they keep -inf as it is)
    for s in range(stop_ids.shape[1]):
        x = torch.where(stopped & (cols == stop_ids[b, s, None]), -torch.inf, x)
    return x.reshape(rows.shape[:-1] + (V,))

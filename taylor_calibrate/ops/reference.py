"""Pure-PyTorch gated delta rule: the GDN token mixer of docs/method.md, "The GDN layer".

One recurrence, two implementations, in flash-linear-attention's layout
(q, k: (B, T, H, K); v: (B, T, H, V); g, beta: (B, T, H); state S: (B, H, K, V)):

    S_t = exp(g_t) * S_{t-1}                         # decay, g_t = log gamma_t <= 0
    S_t = S_t + beta_t * k_t (v_t - S_t^T k_t)^T     # delta-rule write, beta_t in (0, 1)
    o_t = scale * S_t^T q_t                          # read, scale = K ** -0.5 by default

i.e. S_t = gamma_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T, the state stored K x V
(docs/method.md writes its transpose, V x K). `recurrent_gated_delta_rule` is the step-by-step loop and
the ground truth; `chunk_gated_delta_rule` computes the same thing a chunk at a time (WY / UT
transform), which is what makes CPU training affordable. Nothing here imports fla: these are what
the fla kernels (ops/fla.py) are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: the formula of fla's l2norm kernel."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence one step at a time: the specification every other path is tested against.

    Computed in fp32 (fp64 inputs stay fp64). `compute_dtype` overrides that; it exists so tests
    can measure how far a low-precision PyTorch run drifts (flash-attention's tolerance rule).
    Returns (o: (B, T, H, V) in v.dtype, final state (B, H, K, V) in the compute dtype or None).
    """
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    scale = K**-0.5 if scale is None else scale
    dt = compute_dtype or torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)  # (B, H, K, V)
    outs = []
    for t in range(T):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]  # (B, H, K), (B, H, K), (B, H, V)
        S = S * g[:, t].exp()[..., None, None]  # decay
        v_err = v_t - torch.einsum("bhkv,bhk->bhv", S, k_t)  # what the memory gets wrong about v_t
        S = S + beta[:, t, :, None, None] * k_t[..., :, None] * v_err[..., None, :]  # delta write
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q_t))  # (B, H, V)
    o = torch.stack(outs, dim=1)  # (B, T, H, V)
    return o.to(out_dtype), (S if output_final_state else None)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same recurrence, C = chunk_size steps at a time (fp32 inside, differentiable).

    Within a chunk, with G_i = g_1 + ... + g_i (cumulative log decay) and S0 the state entering
    the chunk, unrolling the recurrence gives S_i = e^{G_i} S0 + sum_{j<=i} e^{G_i-G_j} k_j u_j^T,
    where the "pseudo-values" u_i = beta_i (v_i - k_i^T S_{i-1} decayed) satisfy a unit
    lower-triangular system (I + A) u = beta * (v - e^G k S0), A_ij = beta_i e^{G_i-G_j} k_i.k_j
    for j < i. Solving it once per chunk (the WY / UT transform) gives u = U - W S0 with
    U = (I+A)^-1 beta v and W = (I+A)^-1 beta e^G k, so only a (K x V) state crosses chunks:

        o     = scale * (e^G q) S0 + (scale q k^T * e^{G_i-G_j} [j<=i]) u
        S_end = e^{G_C} S0 + (e^{G_C-G} k)^T u

    T is padded to a multiple of C with q = k = v = 0, beta = 0, g = 0: such steps neither
    decay nor write, so padding leaves outputs and state unchanged.
    """
    B, T, H, K = q.shape
    V, out_dtype, C = v.shape[-1], v.dtype, chunk_size
    scale = K**-0.5 if scale is None else scale
    dt = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)

    N = -(-T // C)  # number of chunks
    pad = N * C - T
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))  # (B, N*C, H, D)
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))  # (B, N*C, H)
    q, k, v = (x.reshape(B, N, C, H, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))  # (B, H, N, C, D)
    g, beta = (x.reshape(B, N, C, H).permute(0, 3, 1, 2) for x in (g, beta))  # (B, H, N, C)

    # Everything that does not depend on the incoming state, for all chunks at once.
    G = g.cumsum(-1)  # (B, H, N, C) cumulative log decay within each chunk
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    # e^{G_i - G_j} for j <= i, 0 above the diagonal (masked before exp: no overflow, no NaN grads)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~incl, float("-inf")).exp()  # (B, H, N, C, C)
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # strictly lower
    I_plus_A = A + torch.eye(C, dtype=dt, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * G.exp())[..., None] * k], dim=-1)  # (B, H, N, C, V+K)
    U, W = torch.linalg.solve_triangular(I_plus_A, rhs, upper=False, unitriangular=True).split([V, K], -1)
    attn = scale * (q @ k.transpose(-1, -2)) * decay  # (B, H, N, C, C), causal incl. diagonal
    q_in = scale * q * G.exp()[..., None]  # (B, H, N, C, K): reads the state entering the chunk
    k_out = k * (G[..., -1:] - G).exp()[..., None]  # (B, H, N, C, K): writes into the leaving state
    chunk_decay = G[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1)

    # The only sequential part: pass the (K x V) state from chunk to chunk.
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)  # (B, H, K, V)
    outs = []
    for n in range(N):
        u = U[:, :, n] - W[:, :, n] @ S  # (B, H, C, V)
        outs.append(q_in[:, :, n] @ S + attn[:, :, n] @ u)  # (B, H, C, V)
        S = chunk_decay[:, :, n] * S + k_out[:, :, n].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]  # (B, T, H, V)
    return o.to(out_dtype), (S if output_final_state else None)

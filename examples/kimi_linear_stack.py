#!/usr/bin/env python3
"""A Kimi-Linear-shaped stack served through kdad: the way a serving stack uses kdaclient.

Each layer is pre-norm residual: the projections (q, k, v, a low-rank gate g, beta, an output
gate and the output projection) run here, in PyTorch on the GPU or in NumPy; the Kimi Delta
Attention itself runs in kdad, with one state slot per layer and sequence.  The script

  1. registers the layers' KDA weights (A_log, dt_bias) and allocates the slots,
  2. prefills a batch of prompts of different lengths (one request per layer, all sequences),
  3. continues every sequence with a chunk (chunked prefill, expect_pos checked),
  4. runs 1-token decode steps for all sequences at once (one `step` request per layer, the
     sequences' tokens packed, the projections run once for the batch),

and checks every layer's KDA output against the float64 token loop of KDA.md on the exact
bf16 inputs it sent (the accuracy contract: rel RMS < 0.005), and the stack's final hidden
states against a float64 NumPy model of the whole stack.

    kdad --heads 32 --socket /tmp/kdad.sock &
    python3 examples/kimi_linear_stack.py --socket /tmp/kdad.sock            # NumPy, small
    python3 examples/kimi_linear_stack.py --socket /tmp/kdad.sock --device cuda   # PyTorch

(Real Kimi-Linear layers also run a short causal convolution over q, k and v, whose few
tokens of history a serving stack keeps beside the KDA slot; it is left out here.)
"""
import argparse
import sys
import time

import numpy as np

import kdaclient

H, D = 32, 128                 # Kimi-Linear's KDA heads and head dimension
OUT_TOL = 0.005                # KDA.md: output rel RMS against the float64 token loop
STACK_TOL = 0.02               # final hidden states against the float64 stack


def rel_rms(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2) / max(np.mean(ref ** 2), 1e-300)))


def bf16_round(x):
    """float -> the float64 value of its bf16 rounding (what kdad receives)."""
    return kdaclient.from_bf16(kdaclient.to_bf16(x), np.float64)


def make_weights(rng, d_model, n_layers, rank):
    layers = []
    for _ in range(n_layers):
        w = lambda *shape: rng.standard_normal(shape) / np.sqrt(shape[0])
        layers.append({
            "wq": w(d_model, H * D), "wk": w(d_model, H * D), "wv": w(d_model, H * D),
            "wg_a": w(d_model, rank), "wg_b": w(rank, H * D),        # low-rank gate
            "wb": w(d_model, H), "wo_gate": w(d_model, H * D), "wo": w(H * D, d_model) * 0.5,
            "A_log": rng.uniform(0, 1, H).astype(np.float32),
            "dt_bias": rng.uniform(0, 1, (H, D)).astype(np.float32),
        })
    return layers


def rmsnorm(x, axis=-1):
    return x / np.sqrt(np.mean(x * x, axis=axis, keepdims=True) + 1e-6)


# --------------------------------------------------------------------------------------------
# The served stack: projections in NumPy (float32) or PyTorch, KDA in kdad


class Backend:
    """Projections and element-wise work, in NumPy or in PyTorch (on the GPU)."""

    def __init__(self, device, layers):
        self.torch = None
        if device != "numpy":
            import torch
            self.torch, self.dev = torch, torch.device(device)
            self.w = [{n: torch.tensor(np.asarray(a, np.float32), device=self.dev)
                       for n, a in L.items()} for L in layers]
        else:
            self.w = [{n: np.asarray(a, np.float32) for n, a in L.items()} for L in layers]

    def tensor(self, a):
        return self.torch.tensor(a, dtype=self.torch.float32, device=self.dev) if self.torch \
            else np.asarray(a, np.float32)

    def numpy(self, x):
        return x.float().cpu().numpy() if self.torch else np.asarray(x)

    def bf16(self, x):
        """float32 -> what kdad takes: bf16 (a torch bf16 CUDA tensor, or uint16 bits)."""
        if self.torch:
            return x.to(self.torch.bfloat16).contiguous()
        return kdaclient.to_bf16(x)

    def bits(self, x):
        """A bf16 tensor's bits as a uint16 NumPy array (for the reference check)."""
        if self.torch:
            return x.view(self.torch.int16).cpu().numpy().view(np.uint16)
        return np.array(x, copy=True)

    def from_bf16(self, x):
        return x.float() if self.torch else kdaclient.from_bf16(x)

    def rmsnorm(self, x):
        if self.torch:
            return x * self.torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)
        return rmsnorm(x)

    def sigmoid(self, x):
        return self.torch.sigmoid(x) if self.torch else 1 / (1 + np.exp(-x))

    def empty_out(self, T):
        if self.torch:
            return self.torch.empty((T, H, D), dtype=self.torch.bfloat16, device=self.dev)
        return None    # kdad's output comes back as a new NumPy array

    def sync(self):
        if self.torch and self.dev.type == "cuda":
            self.torch.cuda.synchronize()


class ServedStack:
    def __init__(self, client, be, layers, n_seqs):
        self.c, self.be, self.n = client, be, len(layers)
        self.names = []
        for i, L in enumerate(layers):
            name = "example.kimi_linear.%d" % i
            client.register_layer(name, L["A_log"], L["dt_bias"], lower_bound=-5.0)
            self.names.append(name)
        # one slot per layer and sequence: the sequences' KDA state in every layer
        self.slots = [client.alloc_slots(n_seqs) for _ in layers]
        self.pos = [0] * n_seqs
        self.sent = [[[] for _ in range(n_seqs)] for _ in layers]   # KDA inputs, per layer/seq
        self.got = [[[] for _ in range(n_seqs)] for _ in layers]    # KDA outputs

    def forward(self, xs):
        """One step for every sequence: xs[i] holds its next tokens [T_i, d_model] (T_i may
        differ, and be 1 for decode).  Returns the hidden states after the stack."""
        be = self.be
        hs = [be.tensor(x) for x in xs]
        for li, name in enumerate(self.names):
            w = be.w[li]
            seqs, keep = [], []
            for i, h in enumerate(hs):
                hn = be.rmsnorm(h)
                T = h.shape[0]
                q, k, v = (be.bf16((hn @ w[n]).reshape(T, H, D)) for n in ("wq", "wk", "wv"))
                g = be.bf16(((hn @ w["wg_a"]) @ w["wg_b"]).reshape(T, H, D))
                beta = be.bf16(hn @ w["wb"])
                out = be.empty_out(T)
                s = {"slot": self.slots[li][i], "expect_pos": self.pos[i],
                     "q": q, "k": k, "v": v, "g": g, "beta": beta}
                if out is not None:
                    s["out"] = out
                seqs.append(s)
                keep.append((hn, s))
            # one request per layer carries every sequence: one device launch
            res = self.c.prefill(name, seqs)
            for i, ((hn, s), r) in enumerate(zip(keep, res)):
                T = hs[i].shape[0]
                assert r["pos"] == self.pos[i] + T, (r["pos"], self.pos[i], T)
                o = be.from_bf16(r["out"])
                self.sent[li][i].append({n: be.bits(s[n]) for n in ("q", "k", "v", "g", "beta")})
                self.got[li][i].append(be.numpy(o))
                hs[i] = hs[i] + self.mix_out(w, hn, o)
        for i, x in enumerate(xs):
            self.pos[i] += len(x)
        be.sync()
        return [be.numpy(h) for h in hs]

    def decode(self, xs):
        """One token for every sequence (xs[i]: [1, d_model]): per layer one `step` request
        with the sequences' tokens packed [n, H, 128], the projections run once for the
        batch.  Returns the hidden states after the stack."""
        be, n = self.be, len(xs)
        h = be.tensor(np.concatenate(xs))
        for li, name in enumerate(self.names):
            w = be.w[li]
            hn = be.rmsnorm(h)
            q, k, v = (be.bf16((hn @ w[m]).reshape(n, H, D)) for m in ("wq", "wk", "wv"))
            g = be.bf16(((hn @ w["wg_a"]) @ w["wg_b"]).reshape(n, H, D))
            beta = be.bf16(hn @ w["wb"])
            res = self.c.step(name, self.slots[li], q, k, v, g, beta, expect_pos=self.pos,
                              out=be.empty_out(n))
            assert res["pos"] == [p + 1 for p in self.pos], (res["pos"], self.pos)
            o = be.from_bf16(res["out"])
            for i in range(n):
                self.sent[li][i].append({m: be.bits(t[i:i + 1]) for m, t in
                                         zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta))})
                self.got[li][i].append(be.numpy(o[i:i + 1]))
            h = h + self.mix_out(w, hn, o)
        self.pos = [p + 1 for p in self.pos]
        be.sync()
        return [be.numpy(h[i:i + 1]) for i in range(n)]

    def mix_out(self, w, hn, o):
        """KDA output [T, H, D] -> per-head RMS norm, output gate, projection back."""
        T = o.shape[0]
        o = self.be.rmsnorm(o).reshape(T, H * D) * self.be.sigmoid(hn @ w["wo_gate"])
        return o @ w["wo"]


# --------------------------------------------------------------------------------------------
# The float64 reference: the same stack, token by token, in NumPy


def kda_tokens(q, k, v, g, beta, A_log, dt_bias, S, lower_bound=-5.0,
               scale=kdaclient.DEFAULT_SCALE):
    """KDA.md's token loop over float64 inputs, continuing state S [H, V, K] in place."""
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    a = np.exp(lower_bound / (1 + np.exp(-(np.exp(np.float64(A_log))[None, :, None]
                                           * (g + np.float64(dt_bias)[None])))))
    b = 1 / (1 + np.exp(-beta))
    out = np.empty(q.shape)
    for t in range(q.shape[0]):
        S *= a[t][:, None, :]
        u = b[t][:, None] * (v[t] - np.einsum("hvk,hk->hv", S, k[t]))
        S += u[:, :, None] * k[t][:, None, :]
        out[t] = scale * np.einsum("hvk,hk->hv", S, q[t])
    return out


def reference_stack(layers, x):
    """float64 stack over all of a sequence's tokens at once (rounding to bf16 where the
    served stack hands tensors to kdad)."""
    h = np.asarray(x, np.float64)
    T = len(h)
    for L in layers:
        hn = rmsnorm(h)
        q, k, v = (bf16_round(hn @ L[n]).reshape(T, H, D) for n in ("wq", "wk", "wv"))
        g = bf16_round((hn @ L["wg_a"]) @ L["wg_b"]).reshape(T, H, D)
        beta = bf16_round(hn @ L["wb"])
        o = kda_tokens(q, k, v, g, beta, L["A_log"], L["dt_bias"], np.zeros((H, D, D)))
        o = rmsnorm(o).reshape(T, H * D) * (1 / (1 + np.exp(-(hn @ L["wo_gate"]))))
        h = h + o @ L["wo"]
    return h


def check_kda_outputs(stack, layers):
    """Every layer's KDA output against the token loop on exactly the bf16 inputs sent."""
    worst = 0.0
    for li, L in enumerate(layers):
        for i in range(len(stack.sent[li])):
            cat = {n: np.concatenate([s[n] for s in stack.sent[li][i]])
                   for n in ("q", "k", "v", "g", "beta")}
            f = {n: kdaclient.from_bf16(a.view(np.uint16), np.float64) for n, a in cat.items()}
            ref = kda_tokens(f["q"], f["k"], f["v"], f["g"], f["beta"], L["A_log"],
                             L["dt_bias"], np.zeros((H, D, D)))
            got = np.concatenate(stack.got[li][i])
            worst = max(worst, rel_rms(got, ref))
    return worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socket", help="kdad's socket (default: as kdactl)")
    ap.add_argument("--device", default="numpy",
                    help="numpy (default), or a torch device such as cuda")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--prompts", default="37,64,100", help="prompt lengths, one per sequence")
    ap.add_argument("--chunk", type=int, default=50, help="tokens of the chunked continuation")
    ap.add_argument("--steps", type=int, default=4, help="1-token decode steps")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    prompts = [int(n) for n in args.prompts.split(",")]
    layers = make_weights(rng, args.d_model, args.layers, rank=D)
    total = [p + args.chunk + args.steps for p in prompts]
    tokens = [rng.standard_normal((n, args.d_model)) for n in total]   # input embeddings

    with kdaclient.connect(args.socket, timeout=600) as c:
        if c.heads != H:
            sys.exit("kdad serves H = %d heads; this stack needs %d (kdad --heads %d)"
                     % (c.heads, H, H))
        be = Backend(args.device, layers)
        stack = ServedStack(c, be, layers, len(prompts))
        t0 = time.perf_counter()
        outs = [[] for _ in prompts]
        # 1. batched prefill of the prompts
        for i, h in enumerate(stack.forward([t[:p] for t, p in zip(tokens, prompts)])):
            outs[i].append(h)
        # 2. chunked continuation
        for i, h in enumerate(stack.forward([t[p:p + args.chunk]
                                             for t, p in zip(tokens, prompts)])):
            outs[i].append(h)
        # 3. 1-token decode steps (by prefills of 1-token sequences from a daemon without steps)
        step = stack.decode if "step" in c.hello()["features"] else stack.forward
        for s in range(args.steps):
            at = [p + args.chunk + s for p in prompts]
            for i, h in enumerate(step([t[a:a + 1] for t, a in zip(tokens, at)])):
                outs[i].append(h)
        served_s = time.perf_counter() - t0
        info = c.slot_info()
        assert all(e["pos"] in total for e in info), info

    t0 = time.perf_counter()
    kda_err = check_kda_outputs(stack, layers)
    stack_err = max(rel_rms(np.concatenate(o), reference_stack(layers, t))
                    for o, t in zip(outs, tokens))
    ref_s = time.perf_counter() - t0
    print("kimi_linear_stack: %d layers, H=%d, %d sequences (prompts %s, +%d chunk, +%d steps) "
          "on %s in %.3f s (the float64 references: %.1f s)"
          % (args.layers, H, len(prompts), args.prompts, args.chunk, args.steps, args.device,
             served_s, ref_s))
    print("  KDA outputs vs float64 token loop: worst rel RMS %.2e (contract %.3f)"
          % (kda_err, OUT_TOL))
    print("  final hidden states vs float64 stack: worst rel RMS %.2e (bound %.3f)"
          % (stack_err, STACK_TOL))
    ok = kda_err < OUT_TOL and stack_err < STACK_TOL
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Run SANTA-prop (or flash) once per call at Llama shapes for ncu: python3 prof_santa.py B T [prop|flash] [reps]."""
import sys
import torch
sys.path.insert(0, ".")
from runtime_kernels.santa import triton as tk

b, t = int(sys.argv[1]), int(sys.argv[2])
tiling = sys.argv[3] if len(sys.argv) > 3 else "prop"
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 2
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(b, 32, 128, generator=g, device="cuda").bfloat16()
k = torch.randn(b, 8, t, 128, generator=g, device="cuda").bfloat16()
v = torch.randn(b, 8, t, 128, generator=g, device="cuda").bfloat16()
u = torch.rand(b, 32, -(-t // 256), generator=g, dtype=torch.float64, device="cuda")
n = torch.full((b,), 128 if tiling == "prop" else 2048, device="cuda")
lens = torch.full((b,), t, device="cuda")
for _ in range(reps):
    tk.santa_decode_forward(q, k, v, n, tiling=tiling, tile=256, estimator="sys", scale=128 ** -0.5,
                            uniforms=u, cache_len=lens)
torch.cuda.synchronize()
print("ok", tk.CONFIG)

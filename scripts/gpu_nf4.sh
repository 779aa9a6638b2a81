#!/usr/bin/env bash
# GPU check of NF4 through bitsandbytes (issue 17 moved it from a bench monkey-patch into QuantLinear's kernel
# dispatch, `qerl_cli.kernel_dispatch.bnb_nf4_linear`), in one call: QuantLinear forward and dx on CUDA against
# dequantize + matmul (plain and fused q/k/v-style modules), then the NF4 cells of `qerl bench rollout` and
# `qerl bench step` on the tiny shape. Carry out/rollout_whl and a folder with the bitsandbytes wheel (.whl/).
# Files under $OUT: nf4_check.json, rollout/, step/, gpu_nf4.log.
source "$(dirname "$0")/gpu_common.sh"
job_start gpu_nf4 out/gpu_nf4 "${QERL_DEADLINE_S:-300}"
qerl_shim
install_wheels out/rollout_whl .whl
stamp check
(cd /tmp && python3 - "$OUT/nf4_check.json" <<'PY'
import json, sys, torch
import bitsandbytes
from qerl_cli.formats import dequantize, quantize
from qerl_cli.kernel_dispatch import bnb_nf4_linear
from qerl_cli.qlinear import QuantLinear, fuse_quant_linears
torch.manual_seed(0)
out = {"bitsandbytes": bitsandbytes.__version__, "gpu": torch.cuda.get_device_name(), "cases": []}
def module(n, k):
    qw = quantize((torch.randn(n, k) * 0.02).to(torch.bfloat16), "nf4")
    return QuantLinear(k, n, "nf4", dict(qw.tensors), torch.bfloat16, qw.group_size, None, None).cuda(), qw
for n, k, m in [(256, 512, 1), (256, 512, 7), (4608, 3584, 16), (3584, 18944, 64)]:
    mod, qw = module(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = x.detach() @ dequantize(qw).cuda().t()
    y = mod(x)
    y.sum().backward()
    dx_ref = torch.ones(m, n, device="cuda", dtype=torch.bfloat16) @ dequantize(qw).cuda()
    rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    rel_dx = ((x.grad.float() - dx_ref.float()).norm() / dx_ref.float().norm()).item()
    same = torch.equal(y, bnb_nf4_linear(x.detach(), mod))
    out["cases"].append({"N": n, "K": k, "M": m, "rel": rel, "rel_dx": rel_dx, "forward_is_bnb": same})
parts = [module(256, 512)[0] for _ in range(3)]
fused = fuse_quant_linears(parts)
x = torch.randn(5, 512, device="cuda", dtype=torch.bfloat16)
yf = fused(x)
ys = torch.cat([p(x) for p in parts], dim=-1)
out["fused_equal_parts"] = torch.equal(yf, ys)
ok = all(c["rel"] < 1e-2 and c["rel_dx"] < 1e-2 and c["forward_is_bnb"] for c in out["cases"]) and out["fused_equal_parts"]
out["ok"] = ok
print(json.dumps(out, indent=1)); json.dump(out, open(sys.argv[1], "w"), indent=1)
PY
) 2>&1 | tail -n 40
stamp bench
qerl 120 bench rollout --shape tiny --formats bf16,nf4 --batches 8 --prompt-len 32 --new-tokens 32 --out "$OUT/rollout" 2>&1 | tail -n 12
qerl 120 bench step --shape tiny --formats bf16,nf4 --out "$OUT/step" 2>&1 | tail -n 12
stamp done

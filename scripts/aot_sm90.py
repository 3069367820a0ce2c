"""Compile every Triton kernel for sm_90 (H100/H200) on a machine without a GPU.

Ahead-of-time compilation needs no driver: Triton lowers to PTX and runs the ptxas bundled
with its wheel. For each kernel, at the specialisations the launchers use at real sizes
(V = 128k, support 128, budget 60, head dims 64-256), it prints registers per thread, spill
stack (bytes per thread; > 0 means spills) and shared memory per block (sm_90 limit
232,448 B), so launch configurations can be checked before any GPU time is spent.

    python scripts/aot_sm90.py            # from the repository root, TRITON_INTERPRET unset
    python scripts/aot_sm90.py tree       # only kernels whose name contains "tree"
    python scripts/aot_sm90.py "S=16 " chunk_topk   # names containing any of these

Each kernel is compiled with the options its launcher passes (``LAUNCH_OPTIONS`` where the
module has them), and its PTX is checked for a lane-asymmetric reduction: an FMA that
takes a value another lane shuffled over (``shfl.sync.bfly``) as an operand. The compiler
makes one when it fuses a lane's own product into the first step of a butterfly sum;
lanes then hold differently rounded "equal" sums (slot expansion broke ties by lane on
an H200 that way: docs/gpu.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("aot_sm90: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from rheoplan.kernels import philox_triton  # noqa: E402
from rheoplan.kernels.plan import triton as plan  # noqa: E402
from rheoplan.kernels.slot_expansion import triton as slot  # noqa: E402
from rheoplan.kernels.tree_attention import triton as attn  # noqa: E402
from rheoplan.kernels.verify import triton as verify  # noqa: E402

SM90_SHARED = 232_448


def _signature(kernel, pointer_types: dict, scalars: dict, constexprs: dict) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointer_types.get(name, "*i64")
        else:
            sig[name] = scalars.get(name, "i32")
    return sig


def lane_asymmetric_fmas(ptx: str) -> int:
    """FMAs in ``ptx`` with an operand that ``shfl.sync.bfly`` brought from another lane."""
    shuffled = set(re.findall(r"shfl\.sync\.bfly\.b32\s+(%\w+)", ptx))
    fmas = re.finditer(r"fma\.rn\.f(?:32|64)\s+%\w+, (%\w+), (%\w+), (%\w+);", ptx)
    return sum(1 for m in fmas if shuffled & set(m.groups()))


def compile_one(label, kernel, pointer_types, scalars, constexprs, num_warps=4, num_stages=3, options=None):
    t0 = time.time()
    src = triton.compiler.ASTSource(kernel, _signature(kernel, pointer_types, scalars, constexprs), constexprs)
    try:
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps, "num_stages": num_stages, **(options or {})})
    except Exception as e:  # report and go on: one failing kernel must not hide the others
        print(f"{label:<46} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return False
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    regs, stack = (int(m.group(1)), int(m.group(2))) if m else (-1, -1)
    shared = int(c.metadata.shared)
    asym = lane_asymmetric_fmas(c.asm["ptx"])
    flag = " SPILLS" if stack > 0 else ""
    flag += " OVER-SHARED" if shared > SM90_SHARED else ""
    flag += f" LANE-ASYMMETRIC x{asym}" if asym else ""
    print(f"{label:<46} regs {regs:>3}  stack {stack:>5} B  shared {shared:>7} B  {time.time() - t0:5.1f}s{flag}")
    return stack == 0 and shared <= SM90_SHARED and not asym


def cases():
    import torch

    for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        for d in (64, 80, 96, 128, 256):
            d_pad = triton.next_power_of_2(d)
            bm, bn, nw = attn.launch_config(dt, d_pad)
            ptrs = {n: "*" + name for n in attn.tree_attention_kernel.arg_names if n.endswith("_ptr")}
            ptrs.update(prefix_ptr="*i64", bits_ptr="*i64", part_m_ptr="*fp32", part_l_ptr="*fp32",
                        part_acc_ptr="*fp32")
            for split in (False, True):
                yield (f"tree_attention {name} d={d} {bm}x{bn} w{nw}{' split' if split else ''}",
                       attn.tree_attention_kernel, ptrs, {"SCALE": "fp32"},
                       dict(GROUP=4, D=d, D_PAD=d_pad, BLOCK_M=bm, BLOCK_N=bn,
                            PREC="ieee" if name == "fp32" else "tf32", SPLIT=split), nw)
    for name in ("bf16", "fp32"):
        for d_pad in (64, 128, 256):
            yield (f"tree_attention combine_splits {name} d={d_pad}", attn.combine_splits_kernel,
                   {"part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "out_ptr": "*" + name}, {},
                   dict(D=d_pad, D_PAD=d_pad, BLOCK_R=max(1, min(64, 4096 // d_pad))), 4)
    f32 = {n: "*fp32" for n in ("parent_score_ptr", "cand_q_ptr", "cq_ptr", "sup_q_ptr", "z_ptr", "y_qtilde_ptr",
                                "child_q_ptr", "child_weight_ptr", "child_score_ptr", "part_mx_ptr", "part_s_ptr")}
    for S, logit in ((128, "*bf16"), (128, "*fp32"), (256, "*bf16")):
        ptrs = dict(f32, logits_ptr=logit, noise_ptr="*fp64")
        yield (f"slot_expansion S={S} logits {logit[1:]}", slot.slot_expansion_kernel, ptrs, {"INV_T": "fp32"},
               dict(S=S, S_BLOCK=S, S_TILE=32 if S <= 128 else 16, M=1, K=10, PROXY=0, BLOCK=1024, PROBS=False),
               4 if S <= 128 else 8)
    # the parity tests' size (a 16-entry block: one entry per lane in the reductions)
    yield ("slot_expansion S=16 BLOCK=16 logits fp32", slot.slot_expansion_kernel,
           dict(f32, logits_ptr="*fp32", noise_ptr="*fp64"), {"INV_T": "fp32"},
           dict(S=16, S_BLOCK=16, S_TILE=16, M=1, K=4, PROXY=0, BLOCK=16, PROBS=False), 4)
    # the vocabulary split across programs: chunk statistics, each chunk's top-S, the merge
    for logit in ("*bf16", "*fp32"):
        yield (f"slot softmax_partials logits {logit[1:]}", slot.softmax_partials_kernel,
               dict(f32, logits_ptr=logit), {"INV_T": "fp32"}, dict(BLOCK=1024), 4)
    for S in (128, 256):
        for logit, probs in (("*bf16", False), ("*fp32", True)):  # from logits / from the planner's law
            yield (f"slot chunk_topk S={S} {'probs' if probs else 'logits'} {logit[1:]}", slot.chunk_topk_kernel,
                   dict(f32, logits_ptr=logit), {"INV_T": "fp32"},
                   dict(S=S, S_BLOCK=S, C_BLOCK=32, BLOCK=1024, PROBS=probs), 4)
        yield (f"slot_expansion S={S} merge", slot.slot_expansion_kernel, dict(f32, logits_ptr="*fp32",
               noise_ptr="*fp64"), {"INV_T": "fp32"}, dict(S=S, S_BLOCK=S, S_TILE=32 if S <= 128 else 16, M=1, K=10,
                                                           PROXY=0, BLOCK=1024, PROBS=True, MERGE=True),
               4 if S <= 128 else 8)
    for write_ids in (True, False):
        yield (f"topk write_ids={write_ids} BLOCK=64", plan.topk_kernel, {"score_ptr": "*fp32", "out_ptr":
               "*i64" if write_ids else "*i1"}, {}, dict(WRITE_IDS=write_ids, BLOCK=64), 4)
    for budget in (60, 127, 255, 511):
        L = 1 + budget
        bl = triton.next_power_of_2(L)
        yield (f"linearize budget={budget}", plan.linearize_kernel, {"kept_ptr": "*i1", "mask_ptr": "*i1"}, {},
               dict(W=(L + 63) // 64, D=8, BLOCK_M=min(1024, 4 * bl), BLOCK_L=bl,
                    COL_TILE=min(bl, max(1, min(64, 4096 // bl)))), 8 if bl >= 256 else 4)
    vptr = {"p_ptr": "*fp32", "q_ptr": "*fp32", "u_ptr": "*fp64", "g_ptr": "*fp32", "mass_ptr": "*fp64",
            "best_ptr": "*fp64", "law_ptr": "*fp64"}
    yield ("verify support_law ot", verify.support_law_kernel, vptr, {}, dict(M=1, K=10, CODE=2, S_BLOCK=128), 4)
    for p_type in ("*fp32", "*fp64"):
        yield (f"verify node_mass ot p {p_type[1:]}", verify.node_mass_kernel, dict(vptr, p_ptr=p_type), {},
               dict(M=1, K=10, CODE=2, S_BLOCK=128, BLOCK=1024, DENSE=False), 4)
    for noise in (False, True):
        yield (f"verify node_draw ot noise_in_kernel={noise}", verify.node_draw_kernel, vptr,
               {"seed_arg": "i64", "step_arg": "i32"},
               dict(M=1, K=10, CODE=2, S_BLOCK=128, BLOCK=1024, NB_BLOCK=8, NOISE=noise, PA=2, PR=3, DENSE=False), 4)
    yield ("verify walk (table)", verify.walk_kernel, vptr, {}, dict(C_BLOCK=16, NB_BLOCK=8), 4)
    yield ("philox streams (gumbel)", philox_triton.streams_uniform_kernel, {"out_ptr": "*fp64"},
           {"seed": "i64", "step": "i32", "purpose": "i32", "n": "i32"}, dict(GUMBEL=True, BLOCK=256), 4)


def main(argv: list[str]) -> int:
    print(f"triton {triton.__version__}, target sm_90")
    ok = True
    # the 30 tree-attention specialisations last: under gpu_check.sh's time limit the GPU
    # machine compiled only those (about 50 s) and never reached the other kernels
    for label, kernel, ptrs, scalars, consts, nw in sorted(cases(), key=lambda c: c[0].startswith("tree_attention")):
        if not argv or any(name in label for name in argv):
            options = getattr(sys.modules[kernel.fn.__module__], "LAUNCH_OPTIONS", None)  # as launched
            ok &= compile_one(label, kernel, ptrs, scalars, consts, nw, options=options)
    print("all compiled without spills or lane-asymmetric sums" if ok else
          "some kernels FAILED, spill, exceed shared memory, or sum lane-asymmetrically")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

import sys, os, subprocess, tempfile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))); sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from nsa_titan.kernels import band_gluon as bg
from kernel_resources import parse_usage, BIN

def comp(D, ROWS, WIN, KSTRIDE, KOFF, G):
    fn = bg._band_dkdv_wg
    consts = dict(G=G, KSTRIDE=KSTRIDE, KOFF=KOFF, WIN=WIN, ROWS=ROWS, BK=64, D=D, TPR=min(32, D // 8))
    ptrs = {n: "*bf16" for n in ("Q", "K", "V", "DO")}
    ptrs.update({n: "*fp32" for n in ("LSE", "DELTA", "DKP_", "DVP_")})
    sig, attrs, const = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in consts: sig[n] = "constexpr"; const[(i,)] = consts[n]
        elif n in ptrs: sig[n] = ptrs[n]; attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32" if n.endswith("scale") else "i32"
            if n.startswith("s") and n != "sm_scale": attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=4))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        u = parse_usage(subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout)
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout.splitlines()
    cnt = {op: sum(f" {op}" in l for l in sass) for op in ("HGMMA", "LDL", "STL", "LDGSTS", "BAR")}
    print(D, ROWS, WIN, u, k.metadata.shared, cnt)
    return k

def comp_walk(NW=8):
    from nsa_titan.kernels import selected_gluon as sg
    fn = sg._sel_dkdv_wg
    consts = dict(G=6, LP=64, NSEL=16, BT=10, ROWS=64, D=64, TPR=8, NW=NW)
    ptrs = {n: "*bf16" for n in ("Q", "K", "V", "DO", "DK_", "DV_", "DQP")}
    ptrs.update({n: "*fp32" for n in ("LSE", "DELTA", "PK", "PV")}); ptrs.update({n: "*i32" for n in ("KEYS", "OFF", "COFF", "PROG", "POFF")})
    sig, attrs, const = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in consts: sig[n] = "constexpr"; const[(i,)] = consts[n]
        elif n in ptrs: sig[n] = ptrs[n]; attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32" if n.endswith("scale") else "i32"
            if n.startswith("s") and n != "sm_scale": attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=NW, maxnreg=int(os.environ.get("MAXNREG", "0")) or None))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        u = parse_usage(subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout)
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout.splitlines()
    cnt = {op: sum(f" {op}" in l for l in sass) for op in ("HGMMA", "LDL", "STL", "LDGSTS", "BAR")}
    cnt["sass_lines"] = len(sass)
    print("walk", NW, u, k.metadata.shared, cnt)


if __name__ == "__main__":
    comp_walk(4); comp_walk(8)
    if len(sys.argv) > 1: sys.exit()
    for D, ROWS, WIN, KS, KO, G in [(64, 64, 512, 1, 0, 6), (64, 64, 0, 16, 31, 6), (128, 64, 512, 1, 0, 16)]:
        comp(D, ROWS, WIN, KS, KO, G)

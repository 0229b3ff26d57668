import sys, os, subprocess, tempfile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))); sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernel_resources as kr
from nsa_titan.kernels import selected_bwd
D, G = 64, 6
for rows, nw in ((64, 4), (128, 8)):
  for m in (None, 168, 128):
    consts = dict(LP=64, BS=64, NSEL=16, G=G, GS=G, BT=rows // G, ROWS=rows, DK=D, DV=D, DKP=D, DVP=D, STORE_DS=False, STORE_DQ=True, DOC=False)
    fn = selected_bwd._sel_bwd_dkdv
    pointers = kr.SEL_POINTERS | {"DQP": "*bf16"}
    sig, attrs, const = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in consts: sig[n] = "constexpr"; const[(i,)] = consts[n]
        elif n in pointers: sig[n] = pointers[n]; attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32" if n.endswith("scale") else "i32"
            if n in ("sqb", "sqt", "sqh", "skb", "sks", "skh", "svb", "svs", "svh", "T"): attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 128), options=dict(num_warps=nw, num_stages=2, maxnreg=m))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        u = kr.parse_usage(subprocess.run([os.path.join(kr.BIN, "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout)
        sass = subprocess.run([os.path.join(kr.BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout.splitlines()
    print(rows, nw, m, u["REG"], u["STACK"], {op: sum(f" {op}" in l for l in sass) for op in ("LDL", "STL")}, k.metadata.shared)

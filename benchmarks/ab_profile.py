"""A/B of GPU kernel time: ``profile_block.py`` in this checkout and in a baseline tree, in one call, compared.

    git archive <commit> | tar -x -C /tmp/base                     # the baseline tree (a whole checkout)
    python benchmarks/ab_profile.py --baseline /tmp/base --attention m7c:2,1b --attention-seqs 8192 \
        [--flavors m7c,1b --batch 2,2 --seq 8192] [--rounds 2] [--tag NAME] [--time-limit SECONDS]

Why not ``ab_attention.py``: its eager do_bench times include the host, which at 2k-8k is a large and noisy share
of the attention (NOTES_kernels.md); the sum of kernel times from the profiler is what a change to the kernels
moves. Each tree runs ``profile_block.py`` in its own process, from its own folder, with its own inductor cache
(a shared one made a baseline tree's run fail), and the rounds interleave: baseline, this tree, baseline, ...
Writes ``ab_profile_<tag>_<device>.json`` and ``.md`` (the tag's leading "_" is optional): per case (attention
config or block) each round's total kernel ms, the median's speed-up, and the kernels that moved most, rewritten after
every round (a device call that runs out of time keeps the rounds it finished; ``--time-limit`` starts no round that
would not end in time). Needs a GPU; the comparison itself is tested on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def case_key(row: dict) -> str:
    """One profile_block row (attention or block) -> a stable name for its case."""
    if "config" in row:
        return f"attention {row['config']} T={row['T']} B={row.get('B', 1)}"
    return f"block {row['flavor']} {row['attn_type']} T={row['T']} B={row['B']}"


def kernel_times(payload: dict) -> dict[str, dict]:
    """profile_block payload -> {case: {"total": ms, "kernels": {name: ms}}}."""
    out = {}
    for row in payload.get("attention", []) + payload.get("blocks", []):
        p = row["profile"]
        kernels: dict[str, float] = {}
        for k, ms, _ in p["top"]:  # profile_block shortens names: two kernels may share one, so add them up
            kernels[k] = kernels.get(k, 0.0) + ms
        out[case_key(row)] = {"total": p["kernel_ms"], "kernels": kernels}
    return out


def compare(base_rounds: list[dict], new_rounds: list[dict], top: int = 6) -> list[dict]:
    """Per case: each round's total, the medians, speed-up (baseline / new) and the kernels that moved most
    (medians per kernel, largest absolute change first). Cases missing from a round are left out of its list."""
    rows = []
    for case in base_rounds[0]:
        b = [r[case]["total"] for r in base_rounds if case in r]
        n = [r[case]["total"] for r in new_rounds if case in r]
        if not b or not n:
            continue
        names = set().union(*(r[case]["kernels"] for r in base_rounds + new_rounds if case in r))

        def med(rounds, k):
            return statistics.median(r[case]["kernels"].get(k, 0.0) for r in rounds if case in r)

        moved = sorted(((k, med(base_rounds, k), med(new_rounds, k)) for k in names), key=lambda x: -abs(x[2] - x[1]))
        rows.append(dict(case=case, baseline_ms=b, new_ms=n, baseline_median=statistics.median(b),
                         new_median=statistics.median(n), speedup=statistics.median(b) / statistics.median(n),
                         moved=[dict(kernel=k, baseline=round(x, 4), new=round(y, 4)) for k, x, y in moved[:top]]))
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# A/B of GPU kernel time: {meta.get('device')}", "",
             f"torch {meta.get('torch')}, triton {meta.get('triton')}, {meta.get('date')}; baseline "
             f"`{meta.get('baseline')}` against this tree, {meta.get('rounds_done', meta.get('rounds'))} of "
             f"{meta.get('rounds')} interleaved rounds; sum of kernel "
             "times from torch.profiler (`profile_block.py`), forward + backward.", "",
             "| case | baseline ms (rounds) | new ms (rounds) | speed-up "
             "| kernels that moved most (baseline -> new ms) |",
             "|---|---|---|---|---|"]
    for r in rows:
        moved = "; ".join(f"`{m['kernel'][:40]}` {m['baseline']:.3f} -> {m['new']:.3f}" for m in r["moved"][:3])
        lines.append(f"| {r['case']} | {' / '.join(f'{x:.3f}' for x in r['baseline_ms'])} | "
                     f"{' / '.join(f'{x:.3f}' for x in r['new_ms'])} | {r['speedup']:.3f}x | {moved} |")
    return "\n".join(lines) + "\n"


def run_tree(tree: str, args: list[str], out: str, cache: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "profile_block.py"), *args, "--out", out, "--tag", "_ab"]
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"profile_block.py failed in {tree} (exit {res.returncode}):\n{res.stdout[-2000:]}"
                         f"{res.stderr[-3000:]}")
    (name,) = [f for f in os.listdir(out) if f.startswith("profile_block_ab_") and f.endswith(".json")]
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a whole checkout of the baseline (with benchmarks/)")
    ap.add_argument("--attention", default="", help="profile_block.py --attention")
    ap.add_argument("--attention-seqs", default="8192")
    ap.add_argument("--flavors", default="", help="profile_block.py --flavors (compiled blocks, NSA and dense)")
    ap.add_argument("--batch", default="")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="seconds: start no round that the rounds so far say would end past it (0: no limit)")
    a = ap.parse_args()
    if not os.path.isfile(os.path.join(a.baseline, "benchmarks", "profile_block.py")):
        raise SystemExit(f"--baseline {a.baseline}: no benchmarks/profile_block.py there; pass a whole checkout "
                         "(git archive <commit> | tar -x -C DIR)")
    if not (a.attention or a.flavors):
        raise SystemExit("nothing to profile: pass --attention and/or --flavors")
    args = ["--attention", a.attention, "--attention-seqs", a.attention_seqs, "--seq", str(a.seq)]
    if a.flavors:
        args += ["--flavors", a.flavors] + (["--batch", a.batch] if a.batch else [])
    rounds: dict[str, list[dict]] = {"baseline": [], "new": []}
    meta = dict(baseline=a.baseline, rounds=a.rounds, args=args)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            if i and a.time_limit and time.monotonic() - start > a.time_limit * i / (i + 1):
                print(f"time limit: stopping after {i} of {a.rounds} rounds", flush=True)  # another would not fit
                break
            for label, tree in (("baseline", os.path.abspath(a.baseline)), ("new", REPO)):
                out = os.path.join(tmp, f"{label}{i}")
                os.makedirs(out)
                payload = run_tree(tree, args, out, os.path.join(tmp, f"inductor_{label}"))
                meta.update({k: payload.get(k) for k in ("device", "torch", "triton", "date")})
                rounds[label].append(kernel_times(payload))
                print(label, i, {k: round(v["total"], 4) for k, v in rounds[label][-1].items()}, flush=True)
            # after every round: a call that runs out of time keeps the rounds it finished
            print(write_results(a.out, a.tag, meta, rounds), flush=True)


def write_results(out: str, tag: str, meta: dict, rounds: dict[str, list[dict]]) -> str:
    """ab_profile_<tag>_<device>.json and .md from the rounds done so far (``rounds_done`` says how many); returns
    the markdown."""
    done = min(len(rounds["baseline"]), len(rounds["new"]))
    rows = compare(rounds["baseline"][:done], rounds["new"][:done])
    meta = {**meta, "rounds_done": done}
    tag = tag if not tag or tag.startswith("_") else "_" + tag  # "--tag ring_8k" wrote ab_profilering_8k_*
    base = os.path.join(out, f"ab_profile{tag}_" + str(meta.get("device")).replace(" ", "_"))
    os.makedirs(out, exist_ok=True)
    with open(base + ".json", "w") as f:
        json.dump({**meta, "rows": rows, "rounds": rounds}, f, indent=1)
    md = markdown(rows, meta)
    with open(base + ".md", "w") as f:
        f.write(md)
    return md


if __name__ == "__main__":
    main()

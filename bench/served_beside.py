"""A decode worker's serving factor beside an idle, a busy and a decoding worker, in turn.

Real workers as `baton profile` starts them (a prefill and a decode worker on a core each,
redis-server, two routers): B concurrent streams of C-token prompts through a router to the
decode worker, their time per token (tokens 12-36) over the bare engine's decode step for the
same batch in ``--profile`` (a fresh pool, as the profile's own served grid), once with the
prefill worker idle, once while four clients send 512-2048-token prompts down the remote
path (prefill worker, KV hand-off, decode worker), and (``--beside ...,decoding``) once with
the prefill worker switched to decode and twice the streams split over the two, for each
(C, B) of ``--grid`` and each of ``--rounds`` rounds. The simulator charges a decode
step from the profile's idle factor toward its busy and decoding ones by the share of the
time the other workers were prefilling or decoding (``control/profile.py``); this measures
the three past the profile's grid (16 streams at most), at the batches a decode-heavy
phase runs. JSON in bench/results/served-beside-*.json.

    python bench/served_beside.py --profile bench/results/tune-validation-profile-fast-20261201.json
    # ~3 min on a 2-vCPU VM with the default grid (128x64, 256x64, 128x16, 768x12), 3 rounds
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys

from baton.bench.common import machine, write_result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True,
                    help="the profile whose bare engine is the reference (its model and dtype)")
    ap.add_argument("--grid", default="128x64,256x64,128x16,768x12",
                    help="CONTEXTxSTREAMS points, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cores", default="0,1", help="the two workers' cores")
    ap.add_argument("--beside", default="idle,busy",
                    help="what the other worker does, in turn: idle, busy (prefilling the "
                         "remote path's prompts), decoding (switched to decode: the streams' "
                         "router splits twice the streams over both workers, as 2 colocated "
                         "workers serve them)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    from baton.bench import profile as bp
    from baton.control.profile import CostModel, Profile, ProfileError
    from baton.engine.loader import load_config
    from baton_client.v1 import api_pb2_grpc

    try:
        p = Profile.load(a.profile)
        grid = [tuple(int(x) for x in g.split("x")) for g in a.grid.split(",")]
        besides = a.beside.split(",")
        if any(len(g) != 2 or min(g) < 1 for g in grid) or a.rounds < 1 or not set(
                besides) <= {"idle", "busy", "decoding"}:
            raise ValueError
    except ProfileError as e:
        print(f"error: --profile {a.profile}: {e}", file=sys.stderr)
        return 2
    except ValueError:
        print(f"error: --grid {a.grid!r} / --rounds {a.rounds} / --beside {a.beside!r}: "
              "CONTEXTxSTREAMS points (positive), at least one round, idle, busy or decoding",
              file=sys.stderr)
        return 2
    model = None if p.model == bp.DEFAULT_MODEL else p.model
    fresh = CostModel(dataclasses.replace(p, decode=p.decode_fresh or p.decode))
    cores = [int(c) for c in a.cores.split(",")]
    vocab = min(load_config(model).vocab_size, 10000)
    common = bp._worker_args(model, p.dtype, p.device, 1, [64], grid)
    rows = []
    with contextlib.ExitStack() as stack:
        prefill, _, router, remote = bp._start_cluster(stack, common, bp._groups(cores, 1))
        rstub = api_pb2_grpc.BatonStub(router.channel)
        busy_stub = api_pb2_grpc.BatonStub(remote.channel)
        prompts = bp._Prompts(vocab)
        bp._served_itl(rstub, prompts, 128, 16)  # warm-up: connections, first steps
        for rnd in range(a.rounds):
            for c, b in grid:
                for beside in besides:
                    if beside == "decoding":  # both decode: twice the streams, split in two
                        s = bp._served_decoding(prefill, rstub, prompts, [(c, b)])[0]["s"]
                    else:
                        with (bp._busy_prefill(busy_stub, bp._Prompts(vocab, seed=1 + rnd),
                                               bp.BUSY_PROMPTS) if beside == "busy"
                              else contextlib.nullcontext()):
                            s = bp._served_itl(rstub, prompts, c, b)
                    m = bp._served_model_s(fresh, {"batch": b, "context": c})
                    rows.append({"round": rnd, "context": c, "batch": b, "beside": beside,
                                 "s": s, "model_s": m, "factor": s / m})
                    print(f"round {rnd}: {b:3d} streams x {c:4d} tokens, the other worker "
                          f"{beside}: {s * 1000:7.2f} ms a token, {s / m:.3f}x the bare "
                          "engine", file=sys.stderr, flush=True)
    summary = []
    print(f"{'context':>8} {'streams':>8} " + " ".join(f"{k:>8}" for k in besides)
          + f"  (median factor over {a.rounds} rounds)")
    for c, b in grid:
        med = {k: statistics.median(r["factor"] for r in rows
                                    if (r["context"], r["batch"], r["beside"]) == (c, b, k))
               for k in besides}
        summary.append({"context": c, "batch": b, **med})
        print(f"{c:8d} {b:8d} " + " ".join(f"{med[k]:8.3f}" for k in besides))
    factors = p.factors_beside()
    print("profile: " + ", ".join(f"{v:.3f} {k}" if v is not None else f"no {k} factor"
                                  for k, v in factors.items()))
    path = write_result("served-beside", {
        "profile": a.profile, "grid": grid, "rounds": a.rounds, "beside": besides, "rows": rows,
        "summary": summary, "machine": machine(),
        "profile_factors": factors})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

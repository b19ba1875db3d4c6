"""Soak: many requests through `baton up` on the real model, with clients that cancel, send bad
input or set deadlines they cannot meet, and a worker SIGKILLed every few thousand requests.
Resident memory and open descriptors of every process (redis-server, workers, router) are
sampled as it goes; growth is reported after warm-up; the KV pools are checked at the end (free
== total, no lease, integrity); and every request is accounted for: it succeeds with the greedy
reference's output, or ends with a typed error (a gRPC status, an HTTP status), or it is lost
(hung, an untyped error, a broken connection, a wrong answer). Results in
bench/results/soak-*.json.

    python bench/soak.py [--requests 20000] [--clients 8] [--kill-every 4000] [--up-args "..."]

The default cluster is `baton up --prefill 2 --decode 2 --local-prefill-max-tokens 0`: a killed
worker leaves the other of its role serving while `baton up` restarts it, and every request
moves its KV blocks over NIXL. The newest worker of a role is the one killed, so one of each
role lives from start to end and its memory is measured over the whole run.

Requests (a fixed mix, seeded): prompts drawn from --prompts distinct random token prompts whose
greedy outputs are computed first in this process with the same engine and model; both public
APIs: Baton's gRPC API (a plain generated stub) and the OpenAI API through the official
``openai`` client. Kinds:

    grpc         unary-stream Generate, tokens compared with the reference
    http         /v1/completions (openai client), text compared with the reference
    http-stream  the same, streamed
    cancel       gRPC, cancelled by the client after its first token
    http-close   streamed HTTP, closed by the client after its first chunk
    bad          invalid input on either API: expects INVALID_ARGUMENT / HTTP 400
    deadline     gRPC with a deadline no request can meet: expects DEADLINE_EXCEEDED

Warm-up: the first --warmup share of the requests; growth is the last sample minus the first one
after warm-up, for each process alive from then to the end (a killed worker's replacement starts
after it).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from baton.bench.common import descendants, machine, worker_infos, write_result

KINDS = (("grpc", 55), ("http", 12), ("http-stream", 8), ("cancel", 8), ("http-close", 5),
         ("bad", 6), ("deadline", 6))


def sample(pid: int) -> tuple[int, int] | None:
    """(resident bytes, open fds) of ``pid``; None once it is gone."""
    try:
        rss = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _started(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def name_of(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    text = " ".join(a.decode(errors="replace") for a in args)
    m = re.search(r"baton\.services\.(\w+)", text)
    if m:
        return f"{m.group(1)}-{pid}"
    return f"{Path(args[0].decode()).name}-{pid}"


class Ledger:
    """Every request's ending, by kind: ``ok`` (the reference's output), ``typed`` (a status
    code), ``expected`` (the error the kind asks for), ``lost`` (anything else)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: dict[str, dict[str, int]] = {}
        self.lost: list[str] = []
        self.done = 0

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            row = self.rows.setdefault(kind, {})
            key = outcome if outcome in ("ok", "expected", "lost") else f"typed:{outcome}"
            row[key] = row.get(key, 0) + 1
            if outcome == "lost" and len(self.lost) < 50:
                self.lost.append(f"{kind}: {detail[:300]}")
            self.done += 1

    def count(self, outcome: str) -> int:
        with self.lock:
            return sum(n for row in self.rows.values() for k, n in row.items()
                       if k == outcome or k.startswith(outcome + ":"))


class Clients:
    """The request kinds against one cluster; each call records its ending in the ledger."""

    def __init__(self, grpc_address: str, http_base: str, model: str, prompts, refs,
                 ref_texts, max_tokens: int, ledger: Ledger) -> None:
        import grpc
        import openai
        from baton_client.v1 import api_pb2_grpc

        self._grpc = grpc
        self.stub = api_pb2_grpc.BatonStub(grpc.insecure_channel(grpc_address))
        self.http = openai.OpenAI(base_url=http_base, api_key="unused", max_retries=0,
                                  timeout=300)
        self._openai = openai
        self.model, self.prompts, self.refs, self.ref_texts = model, prompts, refs, ref_texts
        self.max_tokens, self.ledger = max_tokens, ledger

    def run(self, kind: str, rng: random.Random) -> None:
        p = rng.randrange(len(self.prompts))
        try:
            getattr(self, "_k_" + kind.replace("-", "_"))(kind, p, rng)
        except self._grpc.RpcError as e:
            self._grpc_error(kind, e)
        except self._openai.APIStatusError as e:
            self.ledger.add(kind, "expected" if kind == "bad" and e.status_code == 400
                            else f"HTTP {e.status_code}", str(e))
        except Exception as e:  # a broken connection, a timeout, a bug: lost
            self.ledger.add(kind, "lost", f"{type(e).__name__}: {e}")

    def _grpc_error(self, kind: str, e) -> None:
        code = e.code()
        want = {"cancel": "CANCELLED", "deadline": "DEADLINE_EXCEEDED",
                "bad": "INVALID_ARGUMENT"}.get(kind)
        if code is None or code.name in ("UNKNOWN", "INTERNAL"):
            self.ledger.add(kind, "lost", f"{code}: {e.details()}")
        else:
            self.ledger.add(kind, "expected" if code.name == want else code.name)

    def _request(self, p: int, max_tokens: int | None = None):
        from baton_client.v1 import api_pb2

        r = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(
            max_tokens=max_tokens or self.max_tokens, ignore_eos=True))
        r.token_ids.ids.extend(self.prompts[p])
        return r

    def _check(self, kind: str, got, want) -> None:
        if got == want:
            self.ledger.add(kind, "ok")
        else:
            self.ledger.add(kind, "lost", f"wrong answer: {got!r} != {want!r}")

    def _tokens(self, p: int, timeout: float = 300) -> list[int]:
        ids = []
        for m in self.stub.Generate(self._request(p), timeout=timeout):
            if m.HasField("delta"):
                ids += m.delta.token_ids
        return ids

    # ---- the kinds -------------------------------------------------------------------------------

    def _k_grpc(self, kind, p, rng):
        self._check(kind, self._tokens(p), self.refs[p])

    def _k_deadline(self, kind, p, rng):
        self._check(kind, self._tokens(p, timeout=0.002), self.refs[p])

    def _k_cancel(self, kind, p, rng):
        call = self.stub.Generate(self._request(p, max_tokens=64), timeout=300)
        for m in call:
            if m.HasField("delta"):
                call.cancel()
        self.ledger.add(kind, "lost", "finished though cancelled")

    def _completion(self, p, stream: bool, **extra):
        return self.http.completions.create(
            model=self.model, prompt=list(self.prompts[p]), max_tokens=self.max_tokens,
            temperature=0, stream=stream, extra_body={"ignore_eos": True}, **extra)

    def _k_http(self, kind, p, rng):
        r = self._completion(p, False)
        self._check(kind, r.choices[0].text, self.ref_texts[p])

    def _k_http_stream(self, kind, p, rng):
        text = "".join(c.choices[0].text for c in self._completion(p, True) if c.choices)
        self._check(kind, text, self.ref_texts[p])

    def _k_http_close(self, kind, p, rng):
        with self._completion(p, True) as stream:
            for _chunk in stream:
                break  # the client goes away after the first chunk
        self.ledger.add(kind, "expected")

    def _k_bad(self, kind, p, rng):
        from baton_client.v1 import api_pb2

        which = rng.randrange(4)
        if which == 0:  # temperature below 0
            r = self._request(p)
            r.params.temperature = -1.0
            list(self.stub.Generate(r, timeout=300))
        elif which == 1:  # an empty prompt
            list(self.stub.Generate(api_pb2.GenerateRequest(
                text="", params=api_pb2.SamplingParams(max_tokens=4)), timeout=300))
        elif which == 2:  # a field Baton does not implement
            self._completion(p, False, presence_penalty=0.5)
        else:  # a model this cluster does not serve
            self.http.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
        self.ledger.add(kind, "lost", f"bad input {which} accepted")


def references(model: str | None, n: int, lo: int, hi: int, max_tokens: int, seed: int):
    """``n`` random prompts and their greedy outputs (token ids, text), from this process's own
    engine on the same model and dtype as the cluster's."""
    from baton.engine.engine import LLMEngine
    from baton.engine.params import SamplingParams

    engine = LLMEngine.from_path(model)
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(lo, hi))]
               for _ in range(n)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return prompts, [list(o.token_ids) for o in outs], [o.text for o in outs]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=256, help="distinct prompts (default 256)")
    ap.add_argument("--prompt-len", default="8:128", help="MIN:MAX prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--kill-every", type=int, default=4000,
                    help="SIGKILL a worker (decode, then prefill, ...) every this many requests "
                         "(0: never)")
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2)")
    ap.add_argument("--up-args", default="--prefill 2 --decode 2 --local-prefill-max-tokens 0",
                    help="more `baton up` options (default: two workers of each role, so one "
                         "serves while the other is killed and one of each lives through the "
                         "run, and every prompt prefilled on a prefill worker, so every request "
                         "moves KV blocks)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class Run:
    """One soak: `baton up`, its processes' samples, the kills, the ledger."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.t0 = a, time.monotonic()
        self.secret = secrets.token_urlsafe(32)  # so this script can read the workers' pools
        self.ledger = Ledger()
        self.samples: list[dict] = []
        self.names: dict[int, str] = {}
        self.kills: list[dict] = []
        self.lines: list[str] = []

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.0f}s] {msg}", flush=True)

    def start_up(self) -> tuple[str, str]:
        """Start `baton up`; its gRPC address and OpenAI base URL."""
        from baton.transfer import cluster_secret

        a = self.a
        model = ["--model", a.model] if a.model else []
        self.up = subprocess.Popen(
            [sys.executable, "-m", "baton.cli.main", "up", "--grpc-port", "0", "--http-port",
             "0", *model, *shlex.split(a.up_args)], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ,
                                                      cluster_secret.ENV: self.secret})
        for line in self.up.stdout:
            self.lines.append(line)
            if "ready: OpenAI-compatible API" in line:
                break
        text = "".join(self.lines)
        g = re.search(r"gRPC API \(baton.v1.Baton\) on (\S+:\d+);", text)
        h = re.search(r"OpenAI-compatible API on (http\S+)", text)
        if not g or not h:
            self.up.kill()
            raise SystemExit(f"baton up did not start:\n{text}")
        self.redis_url = re.search(r"redis-server on (\S+)", text).group(1)
        threading.Thread(target=lambda: self.lines.extend(self.up.stdout), daemon=True).start()
        self.say(f"baton up serving on {g.group(1)} and {h.group(1)}")
        return g.group(1), h.group(1)

    def take(self) -> None:
        row = {"t": round(time.monotonic() - self.t0, 1), "requests": self.ledger.done,
               "procs": {}}
        for pid in descendants(self.up.pid):
            s = sample(pid)
            if s is not None:
                self.names.setdefault(pid, name_of(pid))
                row["procs"][self.names[pid]] = {"rss": s[0], "fds": s[1]}
        self.samples.append(row)

    def kill_one(self) -> None:
        """SIGKILL the newest worker of the next role (decode, prefill, ...): with two of a role,
        a replacement is the one killed next time, and the other lives from start to end, so
        its memory is measured over the whole run."""
        role = ("decode", "prefill")[len(self.kills) % 2]
        pids = [p for p in descendants(self.up.pid) if name_of(p).startswith(f"{role}-")]
        if pids:
            pid = max(pids, key=_started)
            os.kill(pid, signal.SIGKILL)
            self.kills.append({"at_request": self.ledger.done, "role": role, "pid": pid})
            self.say(f"SIGKILL {role} worker {pid} at request {self.ledger.done}")

    def drive(self, clients: Clients) -> None:
        """--requests requests from --clients threads, sampling and killing as they go."""
        a, ledger = self.a, self.ledger
        kinds = [k for k, w in KINDS for _ in range(w)]
        next_i = iter(range(a.requests))
        lock = threading.Lock()

        def client(c: int) -> None:
            rng = random.Random(a.seed * 1000 + c)
            while True:
                with lock:
                    if next(next_i, None) is None:
                        return
                clients.run(rng.choice(kinds), rng)

        self.take()
        threads = [threading.Thread(target=client, args=(c,), daemon=True)
                   for c in range(a.clients)]
        for t in threads:
            t.start()
        last_say = time.monotonic()
        while any(t.is_alive() for t in threads):
            time.sleep(a.interval)
            self.take()
            if a.kill_every and ledger.done >= (len(self.kills) + 1) * a.kill_every and \
                    ledger.done < a.requests - a.kill_every // 4:
                self.kill_one()
            if time.monotonic() - last_say > 30:
                done = ledger.done
                rate = done / max(1e-9, self.samples[-1]["t"] - self.samples[0]["t"])
                self.say(f"{done}/{a.requests} requests ({ledger.count('lost')} lost), "
                         f"{rate:.1f} req/s, eta {(a.requests - done) / max(rate, 1e-9):.0f}s")
                last_say = time.monotonic()
        self.take()

    def pools(self, wait_s: float = 60.0) -> dict:
        """Every worker's pool once quiet (free == total, no lease), or as it is after
        ``wait_s``; a killed worker's entry (until it lapses) is waited out."""
        end = time.monotonic() + wait_s
        while True:
            infos, gone = worker_infos(self.redis_url, self.secret)
            pools = {wid: {"blocks": i.num_blocks, "free": i.num_free_blocks,
                           "leases": i.active_leases, "running": i.running_requests,
                           "integrity_ok": i.integrity_ok} for wid, i in infos.items()}
            quiet = all(p["free"] == p["blocks"] and not p["leases"] for p in pools.values())
            if (quiet and not gone) or time.monotonic() > end:
                return pools
            time.sleep(0.5)


def main() -> None:
    a = parse_args()
    lo, hi = map(int, a.prompt_len.split(":"))
    run = Run(a)
    run.say(f"greedy references for {a.prompts} prompts ...")
    prompts, refs, ref_texts = references(a.model, a.prompts, lo, hi, a.max_tokens, a.seed)
    run.say("references done")
    grpc_address, http_base = run.start_up()
    try:
        clients = Clients(grpc_address, http_base, "", prompts, refs, ref_texts, a.max_tokens,
                          run.ledger)
        clients.model = clients.http.models.list().data[0].id
        run.drive(clients)
        run.say(f"{run.ledger.done} requests, {run.ledger.count('lost')} lost; "
                "checking the pools")
        pools = run.pools()
    finally:  # never leave the cluster running
        run.up.send_signal(signal.SIGINT)
        run.up.wait(120)
    report(a, run.samples, run.ledger, pools, run.kills, "".join(run.lines))


def report(a, samples, ledger: Ledger, pools: dict, kills: list, up_log: str) -> None:
    warm = next((s for s in samples if s["requests"] >= a.warmup * a.requests), samples[0])
    final = samples[-1]
    after = max(1, final["requests"] - warm["requests"])
    growth = {}
    for proc, v in final["procs"].items():
        w0 = warm["procs"].get(proc)
        if w0 is None:
            continue
        growth[proc] = {"rss_mib_at_warmup": round(w0["rss"] / 2**20, 1),
                        "rss_mib_at_end": round(v["rss"] / 2**20, 1),
                        "rss_growth_pct": round(100 * (v["rss"] - w0["rss"]) / w0["rss"], 2),
                        "rss_growth_kib_per_1k_requests":
                            round((v["rss"] - w0["rss"]) / 1024 / after * 1000, 1),
                        "fds_at_warmup": w0["fds"], "fds_at_end": v["fds"],
                        "fds_growth": v["fds"] - w0["fds"]}
    leaked = sum(p["blocks"] - p["free"] for p in pools.values())
    restarts = re.findall(r"starting it again|back:", up_log)
    result = {"machine": machine(), "args": vars(a), "requests": ledger.done,
              "outcomes": ledger.rows, "ok": ledger.count("ok"),
              "expected_errors": ledger.count("expected"), "typed_errors": ledger.count("typed"),
              "lost": ledger.count("lost"), "lost_examples": ledger.lost,
              "wall_s": round(final["t"] - samples[0]["t"], 1),
              "warmup_requests": warm["requests"], "growth": growth,
              "max_rss_growth_pct": max((g["rss_growth_pct"] for g in growth.values()),
                                        default=None),
              "pools": pools, "leaked_blocks": leaked, "kills": kills,
              "up_restart_lines": len(restarts), "samples": samples}
    path = write_result("soak", result)
    print(f"\n{'process':<24}{'RSS MiB warm->end':>20}{'growth %':>10}{'fds warm->end':>16}")
    for proc, gr in sorted(growth.items()):
        print(f"{proc:<24}{gr['rss_mib_at_warmup']:>9} -> {gr['rss_mib_at_end']:<8}"
              f"{gr['rss_growth_pct']:>10}{gr['fds_at_warmup']:>8} -> {gr['fds_at_end']:<6}")
    print(f"\n{'kind':<14}outcomes")
    for kind, row in sorted(ledger.rows.items()):
        print(f"{kind:<14}{row}")
    print(f"requests {ledger.done}: ok {result['ok']}, expected errors "
          f"{result['expected_errors']}, other typed errors {result['typed_errors']}, lost "
          f"{result['lost']}; kills {len(kills)}; leaked blocks {leaked}; pools {pools}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""What a live session holds, by allocation site: bench/scale.py's harness loop, with
tracemalloc in the proxy, so the resident-set figure it reports can be split into what the
sessions keep and what the allocator keeps after the turns in flight are done.

    .venv/bin/python bench/scale_memory.py [--sessions 16] [--turns 20] [--faults 0.3] [--top 25]

Run directly, it starts one mitmdump with the entry script plus this file as a second script
(``-s bench/scale_memory.py``), a warm-up batch of 4 sessions, then ``--sessions`` at once x
``--turns`` turns (bench/scale.py's ``Rollout``, answers and faults checked the same way). The
proxy takes a tracemalloc snapshot and reads glibc's ``mallinfo2`` when the sessions are made,
when their turns are done (live) and after they are sealed; this script prints the difference
by the newest frame of our own code that allocated it, and the allocator's figures.

Loaded by mitmdump (``SCALE_MEMORY_DIR`` set), it only watches that directory for a request
file ``snapN`` and answers with ``snapN.tm`` (the snapshot), ``memN.txt`` and ``snapN.done``.
tracemalloc slows the proxy several times over: figures of memory only, never of time.
"""

from __future__ import annotations

import os

DIR_ENV = "SCALE_MEMORY_DIR"


def _probe(where: str) -> None:
    """The proxy's side: snapshots on request, from a thread (the event loop is never blocked
    for longer than a snapshot takes)."""
    import ctypes
    import gc
    import threading
    import time
    import tracemalloc

    tracemalloc.start(8)

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def loop() -> None:
        n = 0
        while True:
            if os.path.exists(os.path.join(where, f"snap{n}")):
                gc.collect()
                tracemalloc.take_snapshot().dump(os.path.join(where, f"snap{n}.tm"))
                current, peak = tracemalloc.get_traced_memory()
                tracemalloc.reset_peak()
                mi = libc.mallinfo2()
                with open(os.path.join(where, f"mem{n}.txt"), "w") as f:
                    f.write(f"{current} {peak} {mi.arena} {mi.uordblks} {mi.fordblks}\n")
                open(os.path.join(where, f"snap{n}.done"), "w").close()
                n += 1
            time.sleep(0.1)

    threading.Thread(target=loop, daemon=True, name="scale-memory").start()


if __name__ != "__main__" and os.environ.get(DIR_ENV):
    _probe(os.environ[DIR_ENV])


def main() -> int:
    import argparse
    import collections
    import sys
    import tempfile
    import threading
    import time
    import tracemalloc
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "bench"))
    sys.path.insert(0, str(root / "tests"))
    from mitm import MitmProcess
    from provider import ProviderSimulator
    from scale import KEY_ENV, Rollout, scripted

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--faults", type=float, default=0.3)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-scale-memory-"))
    where = work / "snaps"
    where.mkdir()

    def snap(n: int) -> tuple[tracemalloc.Snapshot, list[int]]:
        (where / f"snap{n}").touch()
        while not (where / f"snap{n}.done").exists():
            time.sleep(0.1)
        return tracemalloc.Snapshot.load(str(where / f"snap{n}.tm")), [int(x) for x in (where / f"mem{n}.txt").read_text().split()]

    def sites(s: tracemalloc.Snapshot) -> collections.Counter:
        by = collections.Counter()
        for t in s.traces:
            ours = [f for f in t.traceback if f.filename.startswith(str(root)) and "/.venv/" not in f.filename]
            f = ours[-1] if ours else t.traceback[-1]
            by[f"{os.path.relpath(f.filename, root) if ours else os.path.basename(f.filename)}:{f.lineno}"] += t.size
        return by

    sim = ProviderSimulator(default=scripted).start()
    proxy = MitmProcess(workdir=work, options={"intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV},
                        env={KEY_ENV: "sk-bench-real-key", DIR_ENV: str(where)}, extra_scripts=[Path(__file__).resolve()])
    problems: list[str] = []
    try:
        proxy.start()
        shots = []
        for batch, size in ((0, 4), (1, args.sessions)):
            sessions = [proxy.create_session() for _ in range(size)]
            if batch:
                shots.append(("made", snap(0), proxy.memory()["VmRSS"]))
            rollouts = [Rollout(i, s, proxy, sim, args, batch) for i, s in enumerate(sessions)]
            threads = [threading.Thread(target=r.run) for r in rollouts]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if batch:
                shots.append(("done (live)", snap(1), proxy.memory()["VmRSS"]))
            for r in rollouts:
                r.verify(proxy)
            if batch:
                shots.append(("sealed", snap(2), proxy.memory()["VmRSS"]))
                problems = [p for r in rollouts for p in r.problems]
            sim.clear()
    finally:
        proxy.cleanup()
        sim.stop()
    n, kib = args.sessions, 1024
    print(f"{n} sessions x {args.turns} turns; per session, over 'made':\n")
    print("| point | RSS | traced (Python heap) | traced peak since the point before | malloc heap | in use | freed, kept |")
    print("|---|---|---|---|---|---|---|")
    (_, (_, base), rss0) = shots[0]
    for name, (_, mem), rss in shots:
        print(f"| {name} | {(rss - rss0) / n / kib:.0f} KiB | {(mem[0] - base[0]) / n / kib:.1f} KiB | "
              f"{(mem[1] - base[0]) / n / kib:.0f} KiB | {(mem[2] - base[2]) / n / kib:.0f} KiB | "
              f"{(mem[3] - base[3]) / n / kib:.0f} KiB | {(mem[4] - base[4]) / n / kib:.0f} KiB |")
    made, done = sites(shots[0][1][0]), sites(shots[1][1][0])
    diff = {k: done[k] - made.get(k, 0) for k in done.keys() | made.keys()}
    turns = n * args.turns
    print(f"\nwhat the live sessions hold, by allocation site (total {sum(diff.values()) / n / kib:.0f} KiB per "
          f"session, {sum(diff.values()) / turns:.0f} B per turn):\n")
    for k, v in sorted(diff.items(), key=lambda x: -x[1])[:args.top]:
        print(f"  {v / turns:7.0f} B/turn  {v / n / kib:6.1f} KiB/session  {k}")
    for p in problems[:10]:
        print("problem:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Long fuzz run: the checks of the test suite's seeded fuzz tests, on thousands of cases.

Targets (default: all): ``loader`` (fast path vs forced cleaner: same rows, same named problems,
untouched spans kept, then the report of what loaded builds), ``receiver`` (every request answered and
in one counter, acknowledged spans written), ``whatif`` (random valid schedules replay; one injected
cycle is refused naming the task). Prints cases and problems found per target; any violated invariant
stops with the failing case (seed and file) in the traceback.

    python bench/fuzz.py                     # 3000 loader cases, 3000 requests, 1000 schedules
    python bench/fuzz.py --target loader --cases 10000 --seed 7
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from tests.analysis.test_loader_fuzz import check_cases  # noqa: E402
from tests.collect.test_receiver_fuzz import fuzz_receiver  # noqa: E402
from tests.whatif.test_impossible_dependencies import _schedule  # noqa: E402

from otel_kvtrace.whatif.replay import replay_run  # noqa: E402
from otel_kvtrace.whatif.task import ReplayInputError  # noqa: E402


def fuzz_loader(cases: int, seed: int) -> str:
    problems = 0
    for chunk in range(0, cases, 200):
        problems += check_cases(min(200, cases - chunk), seed * 10_000 + chunk)["problems"]
    return f"loader: {cases} cases, {problems} named problems, fast path == cleaner on every file"


def fuzz_requests(cases: int, seed: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        stats = fuzz_receiver(Path(tmp), cases * 3 // 4, cases // 4, seed)
    return f"receiver: {cases} requests, {stats.http_requests + stats.grpc_requests} accepted, all answered; " \
           f"{stats.summary()}"


def fuzz_whatif(cases: int, seed: int) -> str:
    refused = 0
    for n in range(cases):
        rng = random.Random(seed * 100_000 + n)
        tasks = _schedule(rng, steps=rng.randint(1, 3), layers=rng.randint(2, 10))
        replay_run(tasks)
        top = max(t.layer_id for t in tasks)
        bad = rng.choice([t for t in tasks if t.layer_id < top])
        bad.gate_id = rng.randint(bad.layer_id, top)
        try:
            replay_run(tasks)
        except ReplayInputError as exc:
            assert f"seq={bad.seq} " in str(exc), exc
            refused += 1
        else:
            raise AssertionError(f"cycle not refused: seed {seed}, case {n}")
    return f"whatif: {cases} valid schedules replayed, {refused} cycles refused naming the task"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["all", "loader", "receiver", "whatif"], default="all")
    parser.add_argument("--cases", type=int, help="cases per target (default 3000; 1000 for whatif)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    runs = {"loader": fuzz_loader, "receiver": fuzz_requests, "whatif": fuzz_whatif}
    for name, fn in runs.items():
        if args.target in ("all", name):
            started = time.perf_counter()
            line = fn(args.cases or (1000 if name == "whatif" else 3000), args.seed)
            print(f"{line} ({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

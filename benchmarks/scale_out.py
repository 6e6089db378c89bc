"""Scale-out: the request rate of load actors on a multi-node Ray cluster, per actor.

Ray's multi-node test cluster (`ray.cluster_utils.Cluster`) on loopback: a head node with no CPUs
for work, and one load node (`pdchaos_load` resource, one CPU) per actor. Ray's scheduler is told to
spread (`scheduler_spread_threshold` 0: each actor goes to the least-used node), so each actor runs
on a node of its own, as on a fleet of client machines; the report says where they ran. The target is
`benchmarks/sse_server.py` (trivial streamed replies, one aiohttp process): the clients are what
is measured, not an engine.

For k = 1 .. --actors actors, in turns (1, 2, ..., then back down, for --rounds rounds), the load
runs exactly as `pdchaos load` runs it: `chaos.load.run_load`, one Locust process per actor,
profile canary-chat (canary-marked prompts on /generate and both OpenAI routes, streamed and not),
every reply parsed, timed and journaled by the driver. --users users per actor with the users'
own think time (0-50 ms), enough to keep each Locust process busy.

Per run: journaled requests/s over the middle of the load (from 5 s after its start to 2 s before
its end), that rate per actor and its ratio to the 1-actor rate of the same round, and the CPU
seconds per request of each kind of process over the same span (/proc, grouped as
`benchmarks/soak.py` groups them: Locust, the load actors, the driver, Ray's daemons, the
server). The last give what `docs/performance.md` derives: the client cores a target rate needs.

    .venv/bin/python benchmarks/scale_out.py                      # 1-2 actors, 2 rounds of 20 s: about 3 min
    .venv/bin/python benchmarks/scale_out.py --actors 2 --duration 20 --rounds 2 \\
        --json benchmarks/results/scale-out/scale-out.json

The cluster, the server and every Locust process are stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from locust_users import free_port, machine  # noqa: E402
from soak import group_of  # noqa: E402

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
WARM_S = 5.0  # Locust spawns its users and Ray places the actors: not the steady rate
COOL_S = 2.0  # the shape stops users near the end
CPU_GROUPS = ("locust", "load_actors", "driver", "ray", "server")


@dataclass
class Point:
    round_no: int
    actors: int
    users_per_actor: int
    duration_s: float
    journaled: int  # every request of the run
    window_requests: int  # sent within the measured span
    window_s: float
    rps: float
    rps_per_actor: float
    per_actor_vs_one: float | None = None  # filled once the round's 1-actor run is known
    cpu_s_per_request: dict[str, float] = field(default_factory=dict)
    cpu_share: dict[str, float] = field(default_factory=dict)  # cores busy on average over the span
    nodes_used: int = 0  # load nodes holding an actor while it ran: one per actor when spread
    load_average: float = 0.0


def start_cluster(nodes: int) -> Any:
    os.environ.update(RAY_ENV)
    from ray.cluster_utils import Cluster

    from chaos.cluster import LOAD_RESOURCE

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "_system_config": {"scheduler_spread_threshold": 0.0},
        },
    )
    for _ in range(nodes):
        cluster.add_node(num_cpus=1, resources={LOAD_RESOURCE: 1})
    cluster.wait_for_nodes()
    return cluster


def start_server(port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "w") as fh:
        server = subprocess.Popen(
            [sys.executable, str(HERE / "sse_server.py"), "--port", str(port)],
            cwd=REPO,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=fh,
        )
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return server
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit(f"the SSE server did not come up; see {log}")


def cpu_by_group(server_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process of ours, by group."""
    driver = os.getpid()
    totals = dict.fromkeys(CPU_GROUPS, 0.0)
    for proc in psutil.process_iter():
        try:
            group = "server" if proc.pid == server_pid else group_of(proc, driver)
            if group in totals:
                times = proc.cpu_times()
                totals[group] += times.user + times.system
        except psutil.Error:
            continue
    return totals


def nodes_with_actors() -> int:
    """Load nodes with some of their load resource taken: each holds at least one actor."""
    from ray._private.state import state

    from chaos.cluster import LOAD_RESOURCE

    total, free = state.total_resources_per_node(), state.available_resources_per_node()
    return sum(
        1
        for node, res in total.items()
        if LOAD_RESOURCE in res and free.get(node, {}).get(LOAD_RESOURCE, 0.0) < res[LOAD_RESOURCE]
    )


class CpuSpan:
    """CPU by group between two moments of a run, sampled from a thread beside the load."""

    def __init__(self, server_pid: int, start_in_s: float, end_in_s: float) -> None:
        self.server_pid = server_pid
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._thread = threading.Thread(target=self._sample, args=(start_in_s, end_in_s), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _sample(self, start_in_s: float, end_in_s: float) -> None:
        origin = time.monotonic()
        for at in (start_in_s, end_in_s):
            time.sleep(max(0.0, origin + at - time.monotonic()))
            self.samples.append((time.time(), cpu_by_group(self.server_pid)))

    def join(self) -> tuple[float, float, dict[str, float]]:
        """(span start, span end, CPU seconds per group within it)."""
        self._thread.join()
        (t0, first), (t1, last) = self.samples
        return t0, t1, {g: last[g] - first[g] for g in CPU_GROUPS}


def one_run(
    cluster: Any, url: str, server_pid: int, actors: int, args: argparse.Namespace, round_no: int, out: Path
) -> Point:
    from chaos.journal import Journal
    from chaos.load import LoadPlan, run_load
    from chaos.markers import new_run_prefix
    from chaos.targets.discovery import TargetFacts
    from loadprofiles.profiles import PROFILES

    run_dir = out / f"round-{round_no}-actors-{actors}"
    run_dir.mkdir(parents=True)
    journal = Journal.create(run_dir)
    plan = LoadPlan(
        target_url=url,
        facts=TargetFacts(),
        profile=PROFILES["canary-chat"],
        run_prefix=new_run_prefix(),
        users=args.users * actors,
        duration_s=args.duration,
        actors=actors,
        max_tokens=32,
        seed=args.seed + round_no,
    )
    span: list[CpuSpan] = []
    used: list[int] = []

    def started(_: float) -> None:  # Locust runs from here: the span counts from the same origin
        span.append(CpuSpan(server_pid, WARM_S, args.duration - COOL_S))
        span[0].start()
        used.append(nodes_with_actors())

    outcome = run_load(plan, run_dir, journal, ray_address=cluster.address, on_started=started)
    t0, t1, cpu = span[0].join()
    sent = [r for r in journal.iter_requests() if r.t_send is not None]
    window = [r for r in sent if t0 <= r.t_send < t1]  # type: ignore[operator]
    journal.close()
    rps = len(window) / (t1 - t0)
    point = Point(
        round_no=round_no,
        actors=actors,
        users_per_actor=args.users,
        duration_s=args.duration,
        journaled=outcome.journaled,
        window_requests=len(window),
        window_s=round(t1 - t0, 2),
        rps=round(rps, 1),
        rps_per_actor=round(rps / actors, 1),
        cpu_s_per_request={g: round(cpu[g] / max(1, len(window)) * 1e6, 1) for g in CPU_GROUPS},
        cpu_share={g: round(cpu[g] / (t1 - t0), 3) for g in CPU_GROUPS},
        nodes_used=used[0] if used else 0,
        load_average=round(os.getloadavg()[0], 2),
    )
    print(
        f"[scale_out] round {round_no + 1}, {actors} actor(s): {point.rps:,.1f} req/s, "
        f"{point.rps_per_actor:,.1f} per actor, Locust {point.cpu_share['locust']:.2f} cores",
        file=sys.stderr,
        flush=True,
    )
    return point


def summarize(points: list[Point]) -> dict[str, Any]:
    by_actors: dict[int, list[Point]] = {}
    for p in points:
        by_actors.setdefault(p.actors, []).append(p)

    summary: dict[str, Any] = {}
    for actors, runs in sorted(by_actors.items()):
        summary[str(actors)] = {
            "rps": round(statistics.median([p.rps for p in runs]), 1),
            "rps_per_actor": round(statistics.median([p.rps_per_actor for p in runs]), 1),
            "per_actor_vs_one": [p.per_actor_vs_one for p in runs],
            "locust_cpu_us_per_request": round(statistics.median([p.cpu_s_per_request["locust"] for p in runs]), 1),
            "client_cpu_us_per_request": round(
                statistics.median([p.cpu_s_per_request["locust"] + p.cpu_s_per_request["load_actors"] for p in runs]), 1
            ),
            "driver_cpu_us_per_request": round(statistics.median([p.cpu_s_per_request["driver"] for p in runs]), 1),
            "server_cpu_us_per_request": round(statistics.median([p.cpu_s_per_request["server"] for p in runs]), 1),
        }
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--actors", type=int, default=2, help="the most actors (and load nodes); runs 1 .. this many")
    p.add_argument("--users", type=int, default=48, help="users per actor (default 48)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per run (default 20)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.duration < WARM_S + COOL_S + 1:
        p.error(f"--duration must be over {WARM_S + COOL_S + 1:g} s: the first {WARM_S:g} s are warm-up")
    if args.actors < 1 or args.users < 1 or args.rounds < 1:
        p.error("--actors, --users and --rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    out = Path(tempfile.mkdtemp(prefix="scale_out-"))
    port = free_port()
    server = start_server(port, out / "server.log")
    cluster = None
    points: list[Point] = []
    try:
        cluster = start_cluster(args.actors)
        counts = list(range(1, args.actors + 1))
        for round_no in range(args.rounds):
            order = counts if round_no % 2 == 0 else list(reversed(counts))
            runs = [one_run(cluster, f"http://127.0.0.1:{port}", server.pid, k, args, round_no, out) for k in order]
            one = next(p for p in runs if p.actors == 1)
            for p in runs:
                p.per_actor_vs_one = round(p.rps_per_actor / one.rps_per_actor, 3) if one.rps_per_actor else None
            points.extend(runs)
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        server.terminate()
        server.wait(timeout=10)
    report = {
        "machine": machine(),
        "command": "benchmarks/scale_out.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "users_per_actor": args.users,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "points": [asdict(p) for p in points],
        "summary": summarize(points),
    }
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

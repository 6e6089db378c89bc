"""The iptables mechanism of a partition: its rules on one (host, port), installed in a chain of
its own hooked into OUTPUT, in a network namespace (`ip netns exec`) or the suite's own."""

from __future__ import annotations

import os
import shutil
import subprocess


def netns_unavailable(netns: str = "") -> str | None:
    """Why iptables partitions cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "iptables needs root (CAP_NET_ADMIN); run the suite as root or skip netns_partition"
    if shutil.which("iptables") is None:
        return "iptables is not installed (apt-get install iptables)"
    if netns:
        if shutil.which("ip") is None:
            return "the `ip` command (iproute2) is not installed"
        listed = _run(["ip", "netns", "list"])
        names = {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
        if netns not in names:
            return f"network namespace {netns!r} does not exist (ip netns list: {sorted(names) or 'none'})"
    probe = _run(_iptables(netns) + ["-L", "OUTPUT", "-n"])
    if probe.returncode != 0:
        return f"iptables cannot run here: {(probe.stderr or probe.stdout).strip()[:200]}"
    return None


def _iptables(netns: str) -> list[str]:
    return (["ip", "netns", "exec", netns] if netns else []) + ["iptables", "-w", "5"]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:  # no such binary, or it hung
        return subprocess.CompletedProcess(argv, 127, "", f"{type(exc).__name__}: {exc}")


def partition_rules(chain: str, host: str, port: int, action: str) -> list[list[str]]:
    """The rule specs of one partition (without the iptables prefix)."""
    target = ["REJECT", "--reject-with", "tcp-reset"] if action == "reject" else ["DROP"]
    return [
        # Resets from the port pass: REJECT's own RST leaves through OUTPUT too, and without
        # this rule the sport rule would swallow it and a reject would behave like a drop.
        ["-A", chain, "-p", "tcp", "-s", host, "--sport", str(port), "--tcp-flags", "RST", "RST", "-j", "RETURN"],
        ["-A", chain, "-p", "tcp", "-d", host, "--dport", str(port), "-j", *target],
        ["-A", chain, "-p", "tcp", "-s", host, "--sport", str(port), "-j", *target],
    ]


def install_partition(netns: str, chain: str, host: str, port: int, action: str) -> None:
    ipt = _iptables(netns)
    steps = [["-N", chain], *partition_rules(chain, host, port, action), ["-I", "OUTPUT", "1", "-j", chain]]
    for step in steps:
        done = _run(ipt + step)
        if done.returncode != 0:
            remove_partition(netns, chain)
            raise RuntimeError(f"iptables {' '.join(step)}: {(done.stderr or done.stdout).strip()}")


def remove_partition(netns: str, chain: str) -> None:
    """Idempotent: unhook the chain from OUTPUT (every copy), flush and delete it."""
    ipt = _iptables(netns)
    for _ in range(16):
        if _run(ipt + ["-D", "OUTPUT", "-j", chain]).returncode != 0:
            break
    _run(ipt + ["-F", chain])
    _run(ipt + ["-X", chain])


def partition_present(netns: str, chain: str) -> bool:
    if shutil.which("iptables") is None:
        return False
    return _run(_iptables(netns) + ["-S", chain]).returncode == 0


def partition_packets(netns: str, chain: str) -> int:
    """Packets the chain's rules matched so far (0 when the chain is gone)."""
    listing = _run(_iptables(netns) + ["-L", chain, "-v", "-x", "-n"])
    if listing.returncode != 0:
        return 0
    total = 0
    for line in listing.stdout.splitlines()[2:]:
        fields = line.split()
        if fields and fields[0].isdigit():
            total += int(fields[0])
    return total

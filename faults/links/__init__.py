"""Link faults: degrade the KV transfer channel or a router->worker link, or partition a port.

- kv_transfer (proxy_faults.py): latency/jitter, bandwidth, reset, truncation or a black hole on
  the KV transfer link, through the fault proxy decode advertises to prefill
  (`SimStackConfig.proxied_links`).
- router_link (proxy_faults.py): latency, or a partition (new connections refused with a RST, live
  ones reset at their next chunk), on router->prefill or router->decode, through the proxy the
  router uses.
- netns_partition (partition.py; the rules in iptables.py): iptables rules (DROP, or REJECT with a
  TCP reset) on one link's destination port, in a network namespace (`ip netns exec`) or in the
  suite's own; see `NetnsPartition`.

Undo: a proxy fault's heal is "clear_proxy" with the proxy's control URL, journaled before
inject, so `pdchaos heal` clears it after a SIGKILL (and stopping the stack stops the proxy).
A partition's rules live as long as a small holder process (`python -m faults.links hold ...`,
__main__.py) started before inject; its heal is "stop_pid", and the holder removes its rules on
SIGTERM.

Confirmation: the proxy's (or the rules') own counters show traffic was touched since inject
AND, for destructive modes (reset, truncate, blackhole, partition), something downstream noticed:
failed-transfer counters on the workers' /metrics, or router errors (5xx responses and worker
errors on the router's /metrics, error lines in its log). Touching nothing is INCONCLUSIVE.
"""

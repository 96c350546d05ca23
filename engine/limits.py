"""Every size limit on user input, in one place: checked before memory or time is spent on it.

The values sit far above any real workload, model or profile, and far below what would exhaust a
laptop's memory or hang a shared dashboard. docs/security.md lists each one with its reason and
how to raise it: edit it here, or from Python assign the module attribute before loading
(`engine.limits.MAX_WORKLOAD_TOKENS = ...`): the checks read it when they run, except the Workload
schema's field bounds (MAX_REQUESTS, MAX_REQUEST_TOKENS), fixed at import. A refusal is
`engine.errors.over_limit`.
"""

# ------------------------------------------------------------------ files

MAX_YAML_BYTES = 1 * 2**20
"""Largest YAML document (workload, hardware profile, deployment to compare): the real ones are
a few KB, and PyYAML parses about 1 MB a second in pure Python."""

MAX_JSON_BYTES = 32 * 2**20
"""Largest JSON document (config.json, calibration, a checkpoint's weight index): DeepSeek-V3's
safetensors index, the largest in common use, is about 9 MB."""

MAX_CONFIG_BYTES = 1 * 2**20
"""Largest model config.json: the catalog's are at most 2.5 KB; one with per-layer lists is still tens of KB."""

MAX_TRACE_BYTES = 256 * 2**20
"""Largest JSONL/CSV trace. It is streamed row by row, so this bounds reading time, not memory:
MAX_REQUESTS rows of ~100 bytes is 100 MB."""

MAX_LINE_BYTES = 64 * 2**10
"""Longest line of a trace: a row is five short fields."""

MAX_NESTING_DEPTH = 64
"""Deepest nesting of lists/mappings in a YAML or JSON document: real files nest 3-5 deep; deeper
would exhaust the parser's recursion (a 100k-deep JSON raises RecursionError)."""

MAX_YAML_NODES = 100_000
"""Most YAML nodes after aliases are expanded. An alias bomb (each level an anchor listing the
previous level nine times) is a few hundred bytes that expands to billions of nodes; counting
expanded nodes while composing refuses it before anything is built. A workload with a
10,000-bin empirical histogram is about 20,000 nodes."""

# ------------------------------------------------------------------ workloads

MAX_REQUESTS = 1_000_000
"""Most requests in a workload (num_requests) or rows in a trace. A request costs a few hundred
bytes of bookkeeping before its tokens, and the simulator runs ~500 chat requests a second
(bench/sim_speed.py): a million is half an hour."""

MAX_REQUEST_TOKENS = 10_000_000
"""Longest prompt or output of one request, tokens: 50x the longest context in the catalog, so it
only catches typos; the model's context length is the real bound and is checked before drawing."""

MAX_WORKLOAD_TOKENS = 20_000_000
"""Most tokens a workload may hold in all: the sum over requests of prompt (conversation history
and shared prefix included) plus output. The simulator keeps about 85 bytes a token (drawn ids,
request state, token times), so this is ~1.7 GB; the 10,000-request chat benchmark is 7M."""

MAX_ARRIVAL_S = 3e7
"""Latest arrival time, seconds (about a year). Simulated time is a float: at 1e300 s a 10 ms step
adds nothing, so a trace row at 1e300 s or a rate of 1e-30 requests/s gives meaningless answers."""

MAX_TRAFFIC_REQUESTS = 50_000_000
"""Most requests a day of traffic (`plan --traffic`) may be expected to bring (its rate integrated
over its hours). They are drawn a chunk at a time, so this bounds time, not memory: the simulator
serves ~500-2,000 requests a wall second (bench/sim_speed.py), so fifty million is 7-28 hours."""


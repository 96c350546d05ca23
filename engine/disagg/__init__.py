"""Disaggregated serving: prefill and decode workers in separate processes, the KV of each
prompt moved between them by a pluggable transport, a router in front (docs/disaggregation.md)."""

from engine.disagg.router import DisaggregatedLLM, DisaggregatedOutput, KVTransfer
from engine.disagg.transport import KVReceiver, KVSender, TransferHandle

__all__ = ["DisaggregatedLLM", "DisaggregatedOutput", "KVReceiver", "KVSender", "KVTransfer", "TransferHandle"]

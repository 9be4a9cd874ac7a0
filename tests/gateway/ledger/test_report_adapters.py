"""`usage report --by adapter` / `--by base_model`: the ledger marks a LoRA adapter's records with its
base model, so usage splits per adapter and rolls up per base model (docs/adapters.md)."""

from __future__ import annotations

from gateway.ledger.report import build_report
from gateway.ledger.writer import decode, encode
from tests.gateway.ledger.records import make_record


def _entries() -> list[dict[str, object]]:
    records = [
        make_record(0, model="llama-3.1-8b"),
        make_record(1, model="sql-lora", base_model="llama-3.1-8b"),
        make_record(2, model="sql-lora", base_model="llama-3.1-8b"),
        make_record(3, model="chat-lora", base_model="llama-3.1-8b"),
        make_record(4, model="qwen2.5-7b"),
    ]
    return [decode(encode(r)) for r in records]


def test_only_adapter_records_carry_their_base_model() -> None:
    entries = _entries()
    assert "base_model" not in entries[0] and entries[1]["base_model"] == "llama-3.1-8b"


def test_report_by_adapter_and_by_base_model() -> None:
    entries = _entries()
    by_adapter = {row["adapter"]: row["requests"] for row in build_report(entries, ["adapter"]).rows()}
    assert by_adapter == {"": 2, "sql-lora": 2, "chat-lora": 1}
    by_base = {row["base_model"]: row["requests"] for row in build_report(entries, ["base_model"]).rows()}
    assert by_base == {"llama-3.1-8b": 4, "qwen2.5-7b": 1}
    both = build_report(entries, ["base_model", "adapter"]).rows()
    assert {(r["base_model"], r["adapter"]) for r in both} == {
        ("llama-3.1-8b", ""), ("llama-3.1-8b", "sql-lora"), ("llama-3.1-8b", "chat-lora"), ("qwen2.5-7b", ""),
    }  # fmt: skip

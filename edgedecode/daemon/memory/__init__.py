"""The decode daemon's KV memory: the ledger (``ledger.MemoryLedger``), the conversations kept
compressed (``store.ConversationStore``) and what a stored conversation is (``conversation``)."""

"""Storage side of refpipe: run URIs, the store, the chunk codec, fetch and the ledger."""

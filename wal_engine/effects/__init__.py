"""External effects: the idempotency gateway, its stores, the HTTP tool helper."""

"""Kafka plumbing both sides share: client options, topic names and admin, the outbox, offset bookkeeping."""

"""`bench pipeline`: the real pipeline (producer -> Kafka -> consumer processes -> results) measured end to end."""

"""batchtide: Kafka-native streaming inference with rate-adaptive micro-batching."""

__version__ = "0.1.0"

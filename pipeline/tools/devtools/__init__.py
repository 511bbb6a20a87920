"""Development tools, apart from the product: a local Kafka broker and a load producer."""

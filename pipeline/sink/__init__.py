"""The sink: the process that loads the consumers' events from Kafka into ClickHouse."""

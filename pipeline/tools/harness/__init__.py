"""The end-to-end harness: the real pipeline run as a user runs it, for the benches, chaos, the demo and the tests.

It starts `batchtide consume` and `batchtide sink` as processes
(`processes`), writes their config file (`config_file`), drives requests with
known ids (`traffic`), reads the results back (`results`) and follows where
the latency events stand (`offsets`, `events`). `deployment` puts these
together for one cost-model pipeline. It sits above the consumers and the
dev tools and below everything that measures, breaks or demonstrates the
pipeline, so they all drive it the same way.
"""

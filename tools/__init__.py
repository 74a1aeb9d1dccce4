"""Tools: converters and benchmarks."""

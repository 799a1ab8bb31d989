"""datamove dataflow stage: spec -> SDFG -> operator graph -> training graph -> fused graph."""

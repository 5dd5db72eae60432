"""The sealed protocol behind every published real-pair figure: the choices frozen in a committed file
(`benchmarks/protocols/*.json`) before the report items are built, stamped by sha256 into every record, and a report
that refuses records made under other choices (`benchmarks.sealed.protocol`, `benchmarks.sealed.report`)."""

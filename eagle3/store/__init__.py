"""The content-addressed artifact store and what lives in it besides artifacts: manifests and the
step versions their keys hold, hidden-state shards' home, done logs a killed step resumes from,
run records and lineage, the promotion registry, and garbage collection."""

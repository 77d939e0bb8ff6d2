"""What a run did, made visible: ``trace`` (spans per rank), ``chrome_trace`` (Perfetto's format), ``visualize``
(every picture, matplotlib imported lazily), ``doctor`` (the hang doctor: heartbeats, the rank that never
arrived)."""

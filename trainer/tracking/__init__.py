"""Tracking and reports: the MLflow store (`store`), one run per job (`runs`), a sweep as a parent
run with children (`sweep`), its comparison table (`report`) and plots (`plots`)."""

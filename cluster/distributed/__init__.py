"""The Ray path: target and draft worker actors behind a Ray-backed engine, the scheduler actor, the engine builder."""

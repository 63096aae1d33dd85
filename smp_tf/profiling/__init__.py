"""Measurements of running steps: memory (`memory`) and the timeline of what each device ran (`timeline`)."""

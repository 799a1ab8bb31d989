"""The stages wired together: the main job, the exported layer and the report."""

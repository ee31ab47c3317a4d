"""course.notebook: what the lab notebooks import while a learner works.

harness (the test cells' helpers and `require_triton`), forbid (what a test switches off
while it runs a learner's function), mine and pieces (`use("mine")`: a learner's saved
definitions swapped into the capstone). Imports the model packages; nothing of the grader.
"""

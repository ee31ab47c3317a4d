"""labkit.course: the nbgrader course — build labs/ from solutions/, check a learner's work,
grade a class in a sandbox, and the lab test harness the lab notebooks import.

Needs the development dependencies (jupytext, nbgrader, jupyter); labkit's experiment half
(run, manifest, reproduce, measure) never imports this package.
"""

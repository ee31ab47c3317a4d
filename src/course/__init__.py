"""course: the nbgrader course around the model packages, one subpackage per audience.

    learner.py      where a learner's own copies live (work/NN-name.ipynb): the paths module
    labserver.py    `python -m course lab`: JupyterLab on the checkout, learner or instructor
    notebook/       what the lab notebooks import: the test harness, forbid lists, `use("mine")`
    authoring/      course developers: solutions/ -> build/course -> labs/, `check`, runtimes
    grader/         instructors: autograde a class, each notebook in a bubblewrap sandbox

`python -m course` is the command line (learner, instructor and developer commands apart).
Needs the development dependencies (jupytext, nbgrader, jupyter); labkit, the experiment
package, never imports this one. The import direction inside runs
learner <- notebook <- authoring <- grader, and nothing here imports upward.
"""

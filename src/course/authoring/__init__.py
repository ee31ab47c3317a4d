"""course.authoring: build the course and check it (course developers; `check` for learners).

build (solutions/*.py -> build/course -> labs/, the graded test cells), exercises
(`check-exercises`: every solution region is graded; `check`: a learner's visible tests),
runtimes (`times`: the stated runtime of each lab), hosted (the Colab cell and badge).
"""

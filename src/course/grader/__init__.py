"""course.grader: autograde a class (instructors).

grading (the class loop, grades.csv, journal, feedback, gradebook), autograde (one notebook:
the learner's cells in a kernel inside a bubblewrap sandbox (sandbox, jupyter_kernel, stubs),
the tests in a trusted kernel, forked from a warm zygote, reaching the learner's code as
data: trusted_side, remote, learner_side, wire, tests_setup, zygote).
"""

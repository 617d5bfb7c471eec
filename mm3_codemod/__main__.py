from rewriter.entry import main

main()

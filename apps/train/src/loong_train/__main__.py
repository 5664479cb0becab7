from loong_train.main import main

main()
